"""benchmarks/models.py: random-weight models of real shapes. Shapes, seeding and the streamed safetensors writer
run everywhere; the whole pipeline (HF -> F16 GGUF -> llama-quantize) on a 256-wide model only where
`benchmarks/peers/build_llama_cpp.py` has built llama-quantize."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_models", REPO / "benchmarks/models.py")
models = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = models  # dataclasses look their module up there
_spec.loader.exec_module(models)

TOOLS_MISSING = models.tools_missing()
SKIP_REASON = (f"llama.cpp tools not built ({', '.join(TOOLS_MISSING)}): run "
               "`python benchmarks/peers/build_llama_cpp.py` (~6 min); CI does not build them")

# A 256-wide Llama with Llama-3's rope scaling and a vocabulary 64 tokens larger than the tokenizer's
# (the converter pads it with [PAD<i>] tokens, as it does up to 128256 for the 1B and 8B shapes).
TINY = {**models.SHAPES["llama-3.2-1b"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": models.TOKENIZER_VOCAB + 64, "tie_word_embeddings": False}


def test_named_shapes_have_the_real_parameter_counts():
    counts = {name: sum(s.numel for s in models.tensor_specs(models.meta_model(cfg)))
              for name, cfg in models.SHAPES.items()}
    assert counts["llama-3.2-1b"] == 1_235_814_400  # tied: no lm_head
    assert counts["llama-3.1-8b"] == 8_030_261_248
    names_1b = {s.name for s in models.tensor_specs(models.meta_model(models.SHAPES["llama-3.2-1b"]))}
    assert "lm_head.weight" not in names_1b and "model.embed_tokens.weight" in names_1b


def test_specs_use_the_checkpoint_layout_not_the_fused_modules():
    mixtral = {**TINY, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
               "num_experts_per_tok": 2}
    specs = {s.name: s for s in models.tensor_specs(models.meta_model(mixtral))}
    assert specs["model.layers.0.block_sparse_moe.experts.3.w1.weight"].shape == (512, 256)  # per expert, as on disk
    assert not any("gate_up_proj" in name for name in specs)
    assert specs["model.layers.1.post_attention_layernorm.weight"].init == "module"


def test_cache_names_key_shape_quant_seed_and_version(tmp_path):
    path = models.gguf_path("llama-3.2-1b", "q4_k_m", 3, tmp_path)
    assert path == tmp_path / f"llama-3.2-1b-Q4_K_M-s3-v{models.VERSION}.gguf"
    name, config = models.resolve_shape(TINY)
    assert name.startswith("llama-") and config == TINY and models.resolve_shape(dict(TINY))[0] == name
    with pytest.raises(ValueError, match="unknown shape"):
        models.resolve_shape("no-such-shape")


def test_weights_are_seeded_per_tensor_and_norms_are_ones():
    model = models.meta_model(TINY)
    specs = {s.name: s for s in models.tensor_specs(model)}
    q = specs["model.layers.0.self_attn.q_proj.weight"]
    first = torch.cat(list(models.tensor_chunks(model, q, 0, 0.02, torch.float16)))
    assert first.shape == (256, 256) and first.dtype == torch.float16
    assert torch.equal(first, torch.cat(list(models.tensor_chunks(model, q, 0, 0.02, torch.float16))))
    assert not torch.equal(first, torch.cat(list(models.tensor_chunks(model, q, 1, 0.02, torch.float16))))
    assert first.float().std().item() == pytest.approx(0.02, rel=0.05)
    norm = specs["model.norm.weight"]
    assert norm.init == "module"
    assert torch.equal(torch.cat(list(models.tensor_chunks(model, norm, 0, 0.02, torch.float16))),
                       torch.ones(256, dtype=torch.float16))


def test_streamed_safetensors_shards_read_back(tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.setattr(models, "CHUNK_BYTES", 4096)  # many chunks per tensor
    model = models.meta_model(TINY)
    specs = models.tensor_specs(model)
    shards = models.plan_shards(specs, 2, limit=8 * 1024**2)
    assert len(shards) > 1 and [s for shard in shards for s in shard] == specs
    path = tmp_path / "shard.safetensors"
    size = models.write_shard(path, model, shards[0], 0, 0.02, torch.float16)
    assert size == path.stat().st_size
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == {s.name for s in shards[0]}
        for spec in shards[0]:
            want = torch.cat(list(models.tensor_chunks(model, spec, 0, 0.02, torch.float16)))
            assert torch.equal(f.get_tensor(spec.name), want.reshape(spec.shape))


def expected_gguf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensor names and (rows, cols) shapes for an untied Llama config with llama3 rope scaling."""
    hidden, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"token_embd.weight": (config["vocab_size"], hidden), "output.weight": (config["vocab_size"], hidden),
              "output_norm.weight": (hidden,), "rope_freqs.weight": (hd // 2,)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"blk.{i}.attn_q.weight": (q, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                       f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, q),
                       f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, inter), f"blk.{i}.attn_norm.weight": (hidden,),
                       f"blk.{i}.ffn_norm.weight": (hidden,)})
    return shapes


@pytest.mark.slow
@pytest.mark.skipif(bool(TOOLS_MISSING), reason=SKIP_REASON)
def test_pipeline_builds_a_quantized_gguf_of_the_config(tmp_path):
    from gguf import GGUFReader
    from safetensors import safe_open

    reports: list = []
    path = models.build_model(TINY, "Q4_K_M", seed=0, cache_dir=tmp_path, keep_hf=True, keep_f16=True,
                              reports=reports)
    name = models.resolve_shape(TINY)[0]
    assert path == models.gguf_path(name, "Q4_K_M", 0, tmp_path) and path.is_file()
    assert [r.stage.split()[0] for r in reports] == ["hf", "convert_hf_to_gguf", "llama-quantize"]
    assert all(r.seconds > 0 and r.peak_rss_bytes > 0 and r.output_bytes > 0 for r in reports)

    tensors = {n: (kind, shape) for n, kind, shape in models.gguf_tensors(path)}
    assert {n: shape for n, (_, shape) in tensors.items()} == expected_gguf_shapes(TINY)
    for n, (kind, shape) in tensors.items():
        assert kind == "F32" if len(shape) == 1 else kind in ("Q4_K", "Q5_K", "Q6_K"), (n, kind)
    assert sum(kind == "Q4_K" for kind, _ in tensors.values()) >= 10

    fields = GGUFReader(str(path)).fields
    value = lambda key: fields[key].contents()  # noqa: E731
    assert value("general.architecture") == "llama" and value("general.file_type") == 15  # MOSTLY_Q4_K_M
    assert (value("llama.embedding_length"), value("llama.block_count"), value("llama.feed_forward_length")) == \
        (256, 2, 512)
    assert (value("llama.attention.head_count"), value("llama.attention.head_count_kv")) == (4, 2)
    assert value("llama.rope.freq_base") == 500000.0 and value("tokenizer.ggml.pre") == "smollm"
    tokens = value("tokenizer.ggml.tokens")
    assert len(tokens) == TINY["vocab_size"] and tokens[-1] == f"[PAD{TINY['vocab_size'] - 1}]"

    # The F16 GGUF holds exactly the float16 weights of the HF directory.
    hf_dir = models.hf_path(name, 0, tmp_path)
    f16 = GGUFReader(str(models.gguf_path(name, "F16", 0, tmp_path)))
    embd = next(t for t in f16.tensors if t.name == "token_embd.weight")
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        want = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(torch.from_numpy(embd.data.copy()).reshape(want.shape), want)
    assert json.loads((hf_dir / "config.json").read_text())["vocab_size"] == TINY["vocab_size"]

    again: list = []
    assert models.build_model(TINY, "q4_k_m", seed=0, cache_dir=tmp_path, reports=again) == path and again == []
