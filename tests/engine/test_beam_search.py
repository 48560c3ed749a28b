"""Beam search equals HF transformers' generate(num_beams=k) and frees every block."""

from __future__ import annotations

import pytest
import torch

from pagemill import BeamSearchParams
from tests.conftest import SMOL_PROMPTS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_hf(smol_llm, smol_hf, width):
    model, tok = smol_hf
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:2]]
    outs = smol_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([p]), do_sample=False, num_beams=width, num_return_sequences=width,
                                 max_new_tokens=8, min_new_tokens=8, eos_token_id=None, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True, length_penalty=1.0,
                                 early_stopping=True)
        ours = [s.tokens for s in out.sequences]
        assert ours == ref.sequences.tolist()
        # HF scores are cum_logprob / generated_length; ours are cumulative logprobs.
        for s, score in zip(out.sequences, ref.sequences_scores.tolist()):
            assert s.cum_logprob / 8 == pytest.approx(score, abs=1e-3)
        assert out.sequences[0].text == tok.decode(out.sequences[0].tokens, skip_special_tokens=True)
    stats = smol_llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total
