"""Baseline backend: Hugging Face transformers `generate` in static batches (float32, greedy)."""

from __future__ import annotations

from typing import Sequence

from pagemill.benchmarks.model_path import load_hf_model, load_hf_tokenizer


def plan_batches(output_lens: Sequence[int], prompt_lens: Sequence[int],
                 batch_size: int) -> list[list[int]]:
    """Group request indices into static batches of similar output (then prompt) length.

    Sorting first keeps padding waste low; every batch then generates its own maximum length.
    """
    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
    order = sorted(range(len(output_lens)), key=lambda i: (output_lens[i], prompt_lens[i]))
    return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]


class HFBackend:
    """Runs requests through `AutoModelForCausalLM.generate` with left padding, batch by batch."""

    name = "hf"

    def __init__(self, model: str, batch_size: int) -> None:
        self.model = load_hf_model(model)
        self.tokenizer = load_hf_tokenizer(model)
        self.batch_size = batch_size
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.generated_tokens = 0  # tokens produced including those past a request's length

    def generate_batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
        """Greedy-generate exactly `new_tokens` tokens (EOS suppressed) for a left-padded batch."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.pad_id)
        self.generated_tokens += int(out[:, width:].numel())
        return [row.tolist() for row in out[:, width:]]

    def generate(self, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                 use_tqdm: bool = False) -> list[list[int]]:
        """Output token ids per request (each cut to its requested length), in input order."""
        from tqdm import tqdm

        results: list[list[int]] = [[] for _ in prompts]
        batches = plan_batches(output_lens, [len(p) for p in prompts], self.batch_size)
        for batch in tqdm(batches, desc="hf batches", disable=not use_tqdm):
            longest = max(output_lens[i] for i in batch)
            outs = self.generate_batch([prompts[i] for i in batch], longest)
            for i, out in zip(batch, outs):
                results[i] = out[:output_lens[i]]
        return results

    def close(self) -> None:
        """Drop the model so a following backend gets the memory."""
        self.model = None
