"""GPU parity: pagemill on CUDA against HF transformers on CUDA, tiny random models of each family.

float32: greedy tokens equal HF's for every request, in every scheduler path: a batch of 32, forced chunked prefill
(16-token steps), prefix-cache hits (the batch again), preemption (a KV cache too small for the batch), with CUDA
graphs and with enforce_eager. bfloat16: top-1 agreement with HF bfloat16 (teacher-forced over HF's greedy
continuation) and the mean |delta logprob|. Prints one line per check and a summary row (PARITY ...).
`--dry-run`: the same on the CPU with the GPU worker (Triton interpreter), two families, a few requests.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build  # noqa: E402


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--root", default="/tmp/pagemill-gpu/models")
    args = ap.parse_args()
    dry = args.dry_run
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from transformers import AutoModelForCausalLM

    from pagemill import LLM, SamplingParams

    device = "cpu" if dry else "cuda"
    extra = dict(worker_cls="pagemill.worker.gpu_worker.GpuWorker", attention_backend="triton") if dry else {}
    kinds = ["llama", "gemma3_text"] if dry else ["llama", "qwen2", "mistral", "qwen3", "gemma3_text", "phi3"]
    n_req, n_out = (3, 4) if dry else (32, 24)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_req)]
    greedy = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    failures, checks = [], 0
    for kind in kinds:
        path = build(kind, args.root)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        refs = [hf_greedy(hf, p, n_out) for p in prompts]
        paths = {"batch": dict(), "chunked": dict(max_num_batched_tokens=16), "eager": dict(enforce_eager=True),
                 "preempt": dict(num_gpu_blocks_override=24, block_size=16, max_model_len=128)}
        if dry:
            paths = {"chunked": paths["chunked"]}
        elif kind not in ("llama", "gemma3_text"):  # (every path on two families, the batch on the others: time)
            paths = {"batch": paths["batch"]}
        for name, over in paths.items():
            t0 = time.perf_counter()
            # (the preemption path: 24 blocks for 32 requests of up to 84 tokens; max_model_len 128 so that one
            # request fits with two KV groups, Gemma 3's sliding + full)
            llm = LLM(path, dtype="float32", max_num_seqs=32, **{"max_model_len": 256, "kv_cache_memory": "64MiB",
                                                                 **extra, **over})
            runs = [("", llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False))]
            if name == "batch":  # the same prompts again: prefix-cache hits
                runs.append(("+prefix", llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                     use_tqdm=False)))
            for suffix, outs in runs:
                checks += 1
                bad = [i for i, o in enumerate(outs) if list(o.outputs[0].token_ids) != refs[i]]
                hits = sum(o.num_cached_tokens for o in outs)
                preempted = llm.get_stats().num_preemptions
                print(f"parity fp32 {kind:12s} {name + suffix:14s} {len(outs) - len(bad)}/{len(outs)} equal "
                      f"(cached tokens {hits}, preemptions {preempted}) {time.perf_counter() - t0:.1f}s", flush=True)
                if bad:
                    failures.append(f"{kind}/{name}{suffix}: requests {bad}")
            del llm
            gc.collect()
        del hf
    agree, dlp = bf16_agreement(args.root, device, extra, dry)
    print(f"PARITY fp32 {checks - len(failures)}/{checks} checks equal; bf16 top-1 agreement {agree:.2%}, "
          f"mean abs dlogprob {dlp:.4f}", flush=True)
    for f in failures:
        print("  FAIL", f)
    return 1 if failures or agree < 0.99 else 0


def bf16_agreement(root: str, device: str, extra: dict, dry: bool) -> tuple[float, float]:
    """pagemill bf16 vs HF bf16, teacher-forced over HF's continuation: pagemill's prompt logprobs (its top-1 and
    the logprob of HF's token at every position) against HF's own logits."""
    from transformers import AutoModelForCausalLM

    from pagemill import LLM, SamplingParams

    path = build("llama", root, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 512, (40,), generator=g).tolist() for _ in range(2 if dry else 16)]
    llm = LLM(path, dtype="bfloat16", max_model_len=256, kv_cache_memory="64MiB", **extra)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
    same = total = 0
    dsum = 0.0
    with torch.inference_mode():
        for s, o in zip(seqs, outs):
            lp = hf(torch.tensor([s], device=device)).logits[0].float().log_softmax(-1).cpu()
            for i, entry in enumerate(o.prompt_logprobs[1:], start=1):  # entry i: the logprobs of token s[i]
                hf_top = int(lp[i - 1].argmax())
                ours_top = max(entry.items(), key=lambda kv: kv[1].logprob)[0]
                same += int(hf_top == ours_top)
                total += 1
                dsum += abs(entry[s[i]].logprob - float(lp[i - 1, s[i]]))
    return same / max(1, total), dsum / max(1, total)


if __name__ == "__main__":
    sys.exit(main())
