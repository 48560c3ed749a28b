"""Presence / frequency / repetition penalties and min_tokens against their formulas, HF, and the Sampler's picks."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

import pagemill.sample.sampler as sampler_mod
from pagemill.sample.metadata import SamplingMetadata
from pagemill.sample.sampler import Sampler, apply_penalties
from pagemill.sampling_params import SamplingParams
from tests.sample.harness import Req, assert_distributions, build_metadata, draw_counts, reference_probs

VOCAB = 16


def reference_penalized(logits: torch.Tensor, req: Req) -> torch.Tensor:
    """OpenAI / vLLM: repetition over prompt + output tokens (positive logits / r, the rest * r), then
    logit -= frequency * count + presence * (count > 0) over the output tokens only; float64."""
    x = logits.to(torch.float64).clone()
    p = req.params
    for t in set(req.prompt) | set(req.output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(req.output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def _random_reqs(n: int, seed: int, greedy: bool = False) -> tuple[torch.Tensor, list[Req]]:
    """n rows with random logits (some exactly 0), histories and penalties (some rows with none at all)."""
    rnd = random.Random(seed)
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    logits[:, 0] = 0.0
    reqs = []
    for i in range(n):
        kw = {} if i % 7 == 0 else dict(presence_penalty=rnd.uniform(-2, 2), frequency_penalty=rnd.uniform(-2, 2),
                                        repetition_penalty=rnd.choice([1.0, rnd.uniform(0.5, 2.0)]))
        prompt = [rnd.randrange(VOCAB) for _ in range(rnd.randrange(1, 9))]
        output = [rnd.randrange(VOCAB) for _ in range(rnd.randrange(0, 9))]
        reqs.append(Req(SamplingParams(temperature=0.0 if greedy else 1.0, **kw), prompt, output))
    return logits, reqs


def test_apply_penalties_matches_formula() -> None:
    """Per-row penalties in one padded batch equal the formula exactly (rows without penalties untouched)."""
    logits, reqs = _random_reqs(200, seed=1)
    got = apply_penalties(logits.clone(), build_metadata(reqs, VOCAB))
    want = torch.stack([reference_penalized(row, r) for row, r in zip(logits, reqs)])
    torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(got, logits)  # the penalties did something


def test_repetition_penalty_matches_hf() -> None:
    """Repetition penalty alone equals HF's RepetitionPenaltyLogitsProcessor over prompt + output ids."""
    logits, reqs = _random_reqs(60, seed=2)
    reqs = [replace(r, params=SamplingParams(repetition_penalty=0.6 + 0.05 * i)) for i, r in enumerate(reqs)]
    got = apply_penalties(logits.clone(), build_metadata(reqs, VOCAB))
    for row, r, out in zip(logits, reqs, got):
        ids = torch.tensor([r.prompt + r.output])
        hf = RepetitionPenaltyLogitsProcessor(penalty=r.params.repetition_penalty)(ids, row.clone()[None])[0]
        torch.testing.assert_close(out, hf)


def _greedy_mismatches(n: int = 2000) -> int:
    """Rows (with a clear winner) where the Sampler's greedy pick is not the argmax of the reference logits."""
    logits, reqs = _random_reqs(n, seed=3, greedy=True)
    tokens, _ = Sampler()(logits.clone(), build_metadata(reqs, VOCAB))
    ref = torch.stack([reference_penalized(row, r) for row, r in zip(logits, reqs)])
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    return int(((tokens != ref.argmax(-1)) & clear).sum())


def test_sampler_greedy_picks_the_penalized_argmax() -> None:
    """Through the Sampler: 2000 greedy rows pick the argmax of the formula's logits (penalties flip ~20% of them)."""
    logits, reqs = _random_reqs(2000, seed=3, greedy=True)
    ref = torch.stack([reference_penalized(row, r) for row, r in zip(logits, reqs)])
    assert (ref.argmax(-1) != logits.argmax(-1)).float().mean() > 0.15
    assert _greedy_mismatches() == 0


def _pad_prompt(md: SamplingMetadata) -> SamplingMetadata:
    """Broken: repetition penalty sees no prompt tokens."""
    return replace(md, prompt_token_ids=torch.full_like(md.prompt_token_ids, VOCAB))


def _output_includes_prompt(md: SamplingMetadata) -> SamplingMetadata:
    """Broken: presence / frequency count the prompt tokens too."""
    return replace(md, output_token_ids=torch.cat([md.prompt_token_ids, md.output_token_ids], dim=1))


def _swap_presence_frequency(md: SamplingMetadata) -> SamplingMetadata:
    """Broken: presence and frequency penalties swapped."""
    return replace(md, presence_penalty=md.frequency_penalty, frequency_penalty=md.presence_penalty)


def _inverted_repetition(md: SamplingMetadata) -> SamplingMetadata:
    """Broken: positive logits multiplied by r, negative divided (1 / r)."""
    return replace(md, repetition_penalty=1.0 / md.repetition_penalty)


@pytest.mark.parametrize("corrupt", [_pad_prompt, _output_includes_prompt, _swap_presence_frequency,
                                     _inverted_repetition],
                         ids=["repetition_ignores_prompt", "frequency_counts_prompt", "presence_frequency_swapped",
                              "repetition_inverted"])
def test_greedy_check_rejects_broken_penalties(monkeypatch: pytest.MonkeyPatch, corrupt) -> None:
    """The greedy-pick check fails when apply_penalties uses a wrong formula."""
    monkeypatch.setattr(sampler_mod, "apply_penalties", lambda logits, md: apply_penalties(logits, corrupt(md)))
    assert _greedy_mismatches() > 20


def test_logprobs_are_raw() -> None:
    """Returned logprobs are the raw log-softmax of the model's logits, before penalties (vLLM's default)."""
    logits, reqs = _random_reqs(20, seed=4)
    md = replace(build_metadata(reqs, VOCAB), max_num_logprobs=3)
    _, raw = Sampler()(logits.clone(), md)
    torch.testing.assert_close(raw, logits.log_softmax(-1))


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    """Below min_tokens the EOS and stop_token_ids are never picked (greedy or sampled); at min_tokens they are."""
    eos, stop = 5, 7
    logits = torch.zeros(4, VOCAB)
    logits[:, eos], logits[:, stop], logits[:, 2] = 4.0, 3.5, 3.0
    reqs = [
        Req(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]), output=[1], eos=eos),
        Req(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]), output=[1, 1, 1], eos=eos),
        Req(SamplingParams(temperature=0.0, min_tokens=3), output=[], eos=None),  # nothing to block
        Req(SamplingParams(min_tokens=2, stop_token_ids=[stop]), output=[3], eos=eos),  # sampled
    ]
    md = build_metadata(reqs, VOCAB)
    tokens, _ = Sampler()(logits.clone(), md)
    assert tokens[:3].tolist() == [2, eos, eos]
    blocked = logits[3].clone()
    blocked[[eos, stop]] = float("-inf")
    counts = draw_counts(logits[3:], build_metadata(reqs[3:], VOCAB), 20_000)
    assert counts[0, eos] == counts[0, stop] == 0
    assert_distributions(counts, reference_probs(blocked, reqs[3].params)[None], ["min_tokens_sampled"])
