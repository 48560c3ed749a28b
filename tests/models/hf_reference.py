"""HF transformers greedy outputs for a real GGUF, computed once in a subprocess and cached by the file's sha256.

transformers loads a GGUF by dequantizing it to float32 (Gemma 3 270M: ~60 s and 3.3 GB peak), so the oracle runs
in its own process (its memory goes back when it exits) and its token ids are cached under
~/.cache/pagemill/hf_reference/, keyed by the file's sha256, the prompts, the token count and the transformers
version. Run as `python -m tests.models.hf_reference GGUF OUT.json < request.json` (what `hf_greedy_cached` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

CACHE_DIR = Path(os.environ.get("PAGEMILL_CACHE", Path.home() / ".cache" / "pagemill")) / "hf_reference"


def file_sha256(path: str) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_key(sha: str, prompts: list[str], max_new_tokens: int) -> str:
    import transformers

    spec = json.dumps({"sha256": sha, "prompts": prompts, "max_new_tokens": max_new_tokens,
                       "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


def hf_greedy_cached(gguf_path: str, prompts: list[str], max_new_tokens: int) -> list[dict]:
    """[{"prompt_token_ids", "output_token_ids"}] per prompt: HF's tokenizer and float32 greedy decode."""
    sha = file_sha256(gguf_path)
    out = CACHE_DIR / f"{sha[:16]}-{_cache_key(sha, prompts, max_new_tokens)}.json"
    if not out.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        request = json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens})
        root = Path(__file__).resolve().parents[2]
        subprocess.run([sys.executable, "-m", "tests.models.hf_reference", gguf_path, str(tmp)], input=request,
                       text=True, check=True, cwd=root)
        tmp.replace(out)
    return json.loads(out.read_text())["results"]


def _compute(gguf_path: str, prompts: list[str], max_new_tokens: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok.encode(prompt)
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=0)
            results.append({"prompt_token_ids": ids, "output_token_ids": gen[0, len(ids):].tolist()})
    return results


if __name__ == "__main__":
    path, out_path = sys.argv[1], sys.argv[2]
    req = json.loads(sys.stdin.read())
    results = _compute(path, req["prompts"], req["max_new_tokens"])
    Path(out_path).write_text(json.dumps({"gguf": os.path.basename(path), "results": results}))
