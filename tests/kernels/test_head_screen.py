"""The greedy LM-head screen (csrc/cpu/variant/head_screen.cpp): int8 logits within their error bound, and every row's
argmax exactly float32's, on each ISA variant (the kernels conftest runs every test once per variant)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import require_kernels, requires_kernels

pytestmark = requires_kernels


@pytest.fixture
def kernels():
    return require_kernels()


def screen(kernels, w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(logits, logits recomputed, per-channel bounds [2, N]: |w - w~| and |w~|) of the screen over w for rows x."""
    q, scales, offsets, bounds = kernels.pack_head_screen(w)
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    tokens = torch.full((x.shape[0],), -1, dtype=torch.int64)
    n = kernels.head_screen(out, x, q, scales, offsets, w, bounds, tokens)
    assert torch.equal(tokens, out.max(1).indices)  # the kernel's argmax is the screened logits' (first maximum)
    return out, n, channel_bounds(bounds, w.shape[0])


def channel_bounds(bounds: torch.Tensor, n: int) -> torch.Tensor:
    """pack_head_screen's bounds [T, 2, 64] as [2, n]: each channel's |w - w~| and |w~|."""
    return bounds.permute(1, 0, 2).reshape(2, -1)[:, :n]


def logit_bounds(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The kernel's bound on |int8 logit - exact logit| [rows, N]: |w_n - w~_n| |x| + |w~_n| |x - x~| (x~: x in int8
    per 32)."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))).clamp(-127, 127)
    e = (g.double() - (amax / 127.0).double() * q.double()).flatten(1).norm(dim=1)
    return x.double().norm(dim=1)[:, None] * bounds[0].double() + e[:, None] * bounds[1].double()


@pytest.mark.parametrize("n_vocab,k,rows", [(1000, 96, 7), (64, 32, 1), (4097, 256, 13), (777, 128, 5), (130, 64, 2)])
def test_argmax_exact_and_int8_logits_within_bound(kernels, n_vocab, k, rows):
    gen = torch.Generator().manual_seed(n_vocab + k)
    w = torch.randn(n_vocab, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    x[:, 3] *= 50.0  # an outlier channel, as LLM hidden states have
    out, recomputed, bounds = screen(kernels, w, x)
    exact = x.double() @ w.double().t()
    assert torch.equal(out.argmax(1), exact.argmax(1))
    assert rows <= recomputed < rows * n_vocab // 4  # the screen recomputes a few per row, never none
    bound = logit_bounds(x, bounds)
    assert ((out.double() - exact).abs() <= bound * 1.001 + 1e-4).all()
    # The recomputed logits are float32 dot products: equal to the float64 result within float32 noise.
    top = out.max(1).values.double()
    assert torch.allclose(top, exact.max(1).values, rtol=1e-5, atol=1e-5)


def _near_tie_table(seed: int, k: int = 64, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, k], w [80, k]): token 2i + 1 is token 2i nudged by 2e-5 along row (i % rows)'s input, so for that
    row it wins by a hair while both round to the same int8 codes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    base = torch.randn(40, k, generator=gen) * 0.05
    direction = x / x.norm(dim=1, keepdim=True)
    nudged = base + 2e-5 * direction[torch.arange(40) % rows]
    return x, torch.stack([base, nudged], dim=1).reshape(80, k).contiguous()


def test_near_ties_the_int8_logits_cannot_see(kernels):
    """Pairs of tokens whose weights round to the same int8 codes but whose exact logits differ by ~1e-5: the
    recheck must pick the larger one for every row."""
    x, w = _near_tie_table(7)
    rows, k = x.shape
    q = kernels.pack_head_screen(w)[0]
    codes = q.permute(0, 2, 1, 3).reshape(-1, k)[:80]
    assert (codes[0::2] == codes[1::2]).all(1).float().mean() > 0.5  # int8 alone cannot tell most pairs apart
    out, _, _ = screen(kernels, w, x)
    exact = x.double() @ w.double().t()
    assert torch.equal(out.argmax(1), exact.argmax(1))


def test_per_channel_bounds_recheck_few_tokens_where_a_few_channels_are_large(kernels):
    """A head whose largest rows are 20x the typical one: bounding every logit by the largest row's norm would
    recompute a large share of the vocabulary; each channel's own bound leaves a handful per row, and exactly
    those whose L~ + B reaches max (L~ - B) (within float32 noise)."""
    gen = torch.Generator().manual_seed(31)
    vocab, k, rows = 4096, 256, 8
    w = torch.randn(vocab, k, generator=gen) * 0.05
    w[::512] *= 20.0  # 8 large rows, as an embedding table's rare tokens can be
    x = torch.randn(rows, k, generator=gen)
    x[:, 5] *= 30.0
    out, recomputed, bounds = screen(kernels, w, x)
    exact = x.double() @ w.double().t()
    assert torch.equal(out.argmax(1), exact.argmax(1))
    b = logit_bounds(x, bounds)
    approx = out.double()  # L~, and the exact logit (within b of it) where recomputed
    per_channel = (approx + b >= (approx - b).max(1, keepdim=True).values).sum().item()
    largest = (approx >= approx.max(1, keepdim=True).values - 2 * b.max(1, keepdim=True).values).sum().item()
    assert rows <= recomputed <= per_channel + rows
    assert recomputed * 8 < largest


def test_q8_0_weights_are_held_exactly(kernels):
    """Weights already on an int8 grid per 32 (a GGUF Q8_0 head) are packed without error: the bound is then the
    activations' quantization alone."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (128, 64), generator=gen).float()
    codes[:, ::32] = 127.0  # every group reaches +-127, as GGUF's quantizer makes it
    d = (torch.rand(128, 2, generator=gen) * 0.01).half().float()  # fp16 scales
    w = (codes.view(128, 2, 32) * d[..., None]).view(128, 64).contiguous()
    _, _, bounds = screen(kernels, w, torch.randn(2, 64, generator=gen))
    assert (bounds[0] == 0.0).all()
    torch.testing.assert_close(bounds[1].double(), w.double().norm(dim=1), rtol=1e-6, atol=0.0)
    assert (bounds[1].double() >= w.double().norm(dim=1)).all()  # rounded up: a bound never below its norm


def test_non_finite_row_is_recomputed_whole(kernels):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    x[1, 4] = float("inf")
    out, recomputed, _ = screen(kernels, w, x)
    assert recomputed >= 200  # the whole non-finite row, plus the others' candidates
    ref = x @ w.t()
    assert torch.equal(out[1].isnan(), ref[1].isnan())
    assert torch.equal(out[[0, 2]].argmax(1), ref[[0, 2]].argmax(1))


def test_rejects_bad_shapes(kernels):
    w = torch.randn(100, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_head_screen(w)
    w = torch.randn(100, 64)
    q, scales, offsets, bounds = kernels.pack_head_screen(w)
    with pytest.raises(RuntimeError, match="logits"):
        kernels.head_screen(torch.empty(2, 99), torch.randn(2, 64), q, scales, offsets, w, bounds)
    with pytest.raises(RuntimeError, match="bounds"):
        kernels.head_screen(torch.empty(2, 100), torch.randn(2, 64), q, scales, offsets, w, bounds[:1])


# ---- structured output: a bitmask row per screened row (bit set = allowed) ----

def pack_mask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, V] -> int32 [R, ceil(V / 32)] bitmask, xgrammar's layout (bit t % 32 of word t // 32)."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def masked_screen(kernels, w: torch.Tensor, x: torch.Tensor, bitmask: torch.Tensor,
                  mask_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the screen's tokens, its logits) with bitmask row mask_rows[r] on row r (-1: none)."""
    q, scales, offsets, bounds = kernels.pack_head_screen(w)
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    tokens = torch.full((x.shape[0],), -1, dtype=torch.int64)
    kernels.head_screen(out, x, q, scales, offsets, w, bounds, tokens, bitmask,
                        torch.tensor(mask_rows, dtype=torch.int64))
    return tokens, out


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: list[int]) -> torch.Tensor:
    """What the exact path gives: the bitmask applied (pagemill.sample.bitmask), then torch's max."""
    from pagemill.sample.bitmask import apply_token_bitmask_torch

    logits = logits.clone()
    masked = [r for r, m in enumerate(mask_rows) if m >= 0]
    if masked:
        apply_token_bitmask_torch(logits, bitmask[[mask_rows[r] for r in masked]], torch.tensor(masked))
    return logits.max(1).indices


def test_masked_rows_take_the_argmax_over_allowed_tokens(kernels):
    """Dense, sparse, single-token and empty masks next to unmasked rows; the global argmax always disallowed."""
    gen = torch.Generator().manual_seed(11)
    vocab, k, rows = 1000, 96, 9
    w = torch.randn(vocab, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    x[:, 3] *= 50.0
    exact = x.double() @ w.double().t()
    density = [0.9, 0.5, 0.02, 0.9, 0.0, 0.3, 0.9, 0.1, 0.9]
    allowed = torch.rand(rows, vocab, generator=gen) < torch.tensor(density)[:, None]
    allowed[torch.arange(rows), exact.argmax(1)] = False  # the unmasked argmax is never the answer
    allowed[2] = False
    allowed[2, 777] = True  # all but one disallowed
    bitmask = pack_mask(allowed)
    mask_rows = [0, 1, 2, -1, 4, 5, -1, 7, 8]  # rows 3 and 6 unconstrained
    tokens, out = masked_screen(kernels, w, x, bitmask, mask_rows)
    assert torch.equal(tokens, masked_argmax(exact, bitmask, mask_rows))
    assert tokens[2] == 777 and tokens[4] == 0  # nothing allowed: token 0, as torch's max over a row of -inf
    assert torch.equal(tokens[[3, 6]], exact[[3, 6]].argmax(1))
    # The mixed-batch path masks the screen's logits again and takes the max: the same tokens.
    assert torch.equal(masked_argmax(out, bitmask, mask_rows)[[0, 1, 2, 3, 5, 6, 7, 8]],
                       tokens[[0, 1, 2, 3, 5, 6, 7, 8]])


def test_masked_near_ties_the_int8_logits_cannot_see(kernels):
    """Pairs of allowed tokens whose int8 codes agree but whose exact logits differ by ~1e-5 (the grammar disallows
    the row's overall best pair): the recheck picks the larger allowed one."""
    x, w = _near_tie_table(17)
    rows, k = x.shape
    exact = x.double() @ w.double().t()
    allowed = torch.ones(rows, 80, dtype=torch.bool)
    for r in range(rows):
        best_pair = int(exact[r].argmax()) // 2
        allowed[r, 2 * best_pair:2 * best_pair + 2] = False
    bitmask = pack_mask(allowed)
    mask_rows = list(range(rows))
    tokens, _ = masked_screen(kernels, w, x, bitmask, mask_rows)
    assert torch.equal(tokens, masked_argmax(exact, bitmask, mask_rows))
    assert all(allowed[r, tokens[r]] for r in range(rows))


def test_mask_words_shorter_than_the_vocabulary_disallow_the_rest(kernels):
    """Tokens past the bitmask's words (a head wider than the tokenizer's vocabulary) are disallowed, as
    apply_token_bitmask does; a mask wider than the vocabulary is read only up to it."""
    gen = torch.Generator().manual_seed(23)
    vocab, k = 200, 32
    w = torch.randn(vocab, k, generator=gen) * 0.05
    w[150:] += 1.0  # the tail would win every row
    x = torch.randn(4, k, generator=gen).abs()
    exact = x.double() @ w.double().t()
    short = pack_mask(torch.ones(1, 128, dtype=torch.bool))  # 4 words: tokens 0..127
    tokens, _ = masked_screen(kernels, w, x, short, [0, 0, -1, 0])
    assert (tokens[[0, 1, 3]] < 128).all() and tokens[2] >= 150
    assert torch.equal(tokens[[0, 1, 3]], exact[[0, 1, 3], :128].argmax(1))
    wide = pack_mask(torch.ones(1, 256, dtype=torch.bool))
    assert torch.equal(masked_screen(kernels, w, x, wide, [0, 0, 0, 0])[0], exact.argmax(1))


def test_masked_non_finite_row_is_recomputed_over_allowed_tokens(kernels):
    gen = torch.Generator().manual_seed(29)
    w = torch.randn(200, 32, generator=gen)
    x = torch.randn(2, 32, generator=gen)
    x[0, 4] = float("inf")
    allowed = torch.zeros(2, 200, dtype=torch.bool)
    allowed[:, 50:60] = True
    bitmask = pack_mask(allowed)
    tokens, _ = masked_screen(kernels, w, x, bitmask, [0, 1])
    assert torch.equal(tokens, masked_argmax(x @ w.t(), bitmask, [0, 1]))


def test_mask_arguments_are_checked(kernels):
    w = torch.randn(100, 64)
    q, scales, offsets, bounds = kernels.pack_head_screen(w)
    args = (torch.empty(2, 100), torch.randn(2, 64), q, scales, offsets, w, bounds, None)
    bitmask = torch.full((1, 4), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="go together"):
        kernels.head_screen(*args, bitmask, None)
    with pytest.raises(RuntimeError, match="mask_rows out of range"):
        kernels.head_screen(*args, bitmask, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="int32"):
        kernels.head_screen(*args, bitmask.long(), torch.tensor([0, 0]))
