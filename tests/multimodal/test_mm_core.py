"""Without a model: image-keyed block hashes, the scheduler's encoder budget, placeholder spans, image checks."""

from __future__ import annotations

import pytest

from pagemill.config import CacheConfig, SchedulerConfig
from pagemill.core.kv_cache_utils import KVCacheConfig, extend_block_hashes, get_hash_fn
from pagemill.core.scheduler import Scheduler
from pagemill.messages import MultiModalFeature
from pagemill.multimodal.image import MultiModalInputError, decode_image_bytes, load_image_url
from pagemill.multimodal.processing import placeholder_spans
from pagemill.request import Request
from pagemill.sampling_params import SamplingParams

IMG = 99


def feature(offset: int, length: int, ident: str) -> MultiModalFeature:
    return MultiModalFeature(ident, offset, length, b"", [0])


def hashes(tokens, spans) -> list[int]:
    out: list[int] = []
    extend_block_hashes(get_hash_fn("builtin"), out, tokens, 4, len(tokens) // 4, None, spans)
    return out


def test_block_hashes_key_the_placeholder_blocks_by_image():
    tokens = [1, 2, 3, 4, 5, 6] + [IMG] * 8 + [7, 8, 9, 10, 11, 12]
    a, b = hashes(tokens, [(6, 8, "a")]), hashes(tokens, [(6, 8, "b")])
    assert a[0] == b[0]  # the block before the image is shared
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # every block from the image's first on differs
    assert a == hashes(tokens, [(6, 8, "a")])
    assert hashes(tokens, None) == hashes(tokens, [])  # text-only hashes are unchanged


def make_request(rid: str, n_text: int, images: list[tuple[int, int]]) -> Request:
    tokens = [5] * n_text
    req = Request(rid, tokens, SamplingParams(max_tokens=4), None, 0.0)
    req.mm_features = [feature(off, n, f"{rid}{k}") for k, (off, n) in enumerate(images)]
    return req


def test_encoder_budget_stops_a_chunk_before_an_image():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, max_num_encoder_input_tokens=16),
                  CacheConfig(block_size=4), KVCacheConfig(64, 4))
    s.add_request(make_request("a", 40, [(2, 16)]))
    s.add_request(make_request("b", 40, [(4, 16), (24, 16)]))
    out = s.schedule()
    # a's image takes the whole encoder budget; b stops before its first image
    assert out.num_scheduled_tokens == {"a": 40, "b": 4}
    assert s.requests["b"].num_images_scheduled == 0


def test_an_image_over_the_encoder_budget_still_runs_first():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, max_num_encoder_input_tokens=8),
                  CacheConfig(block_size=4), KVCacheConfig(64, 4))
    s.add_request(make_request("a", 30, [(0, 16)]))
    assert s.schedule().num_scheduled_tokens == {"a": 30}


def test_disable_chunked_mm_input_never_splits_an_image():
    # 20-token steps: a's chunk stops before its image (8..24) rather than inside it; the next step takes the image
    # whole; b (admitted in the same step) stops at its image's start, and waits while its image does not fit
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_model_len=256, disable_chunked_mm_input=True),
                  CacheConfig(block_size=4, enable_prefix_caching=False), KVCacheConfig(64, 4))
    s.add_request(make_request("a", 40, [(8, 16)]))
    s.add_request(make_request("b", 40, [(14, 16)]))
    steps = []
    for _ in range(4):
        out = s.schedule()
        steps.append(out.num_scheduled_tokens)
    assert steps[0] == {"a": 8, "b": 12}
    assert steps[1] == {"a": 20}  # the image (8..24) and 4 tokens after it; b's image does not fit behind it
    assert steps[2] == {"a": 12, "b": 2}  # a's last 12 tokens; b up to its image start
    assert steps[3] == {"b": 20}  # b's image whole
    for rid, spans in (("a", (8, 24)), ("b", (14, 30))):
        ends = set()
        total = 0
        for st in steps:
            total += st.get(rid, 0)
            ends.add(total)
        assert not any(spans[0] < e < spans[1] for e in ends)


def test_placeholder_spans():
    ids = [1, IMG, IMG, 2, IMG, IMG, IMG, IMG, 3]
    assert placeholder_spans(ids, IMG, 2) == [(1, 2), (4, 4)]
    assert placeholder_spans(ids[:3] + ids[4:], IMG, 3) == [(1, 2), (3, 2), (5, 2)]  # adjacent images split
    with pytest.raises(ValueError, match="multi_modal_data"):
        placeholder_spans(ids, IMG, 4)


@pytest.mark.parametrize("url,text", [
    ("data:image/png;base64,!!!", "base64"),
    ("data:image/png," + "abc", "base64"),
    ("data:application/json;base64,e30=", "application/json"),
    ("gopher://x", "scheme"),
    ("file:///etc/passwd", "allowed-local-media-path"),
    ("", "non-empty"),
])
def test_bad_image_urls_name_the_field(url, text):
    with pytest.raises(MultiModalInputError, match=text) as e:
        load_image_url(url, "messages.0.content.0.image_url")
    assert e.value.param == "messages.0.content.0.image_url"


def test_file_urls_only_under_the_allowed_path(tmp_path):
    from PIL import Image

    inside = tmp_path / "ok" / "a.png"
    inside.parent.mkdir()
    Image.new("RGB", (4, 4)).save(inside)
    assert load_image_url(f"file://{inside}", "x", str(inside.parent)).size == (4, 4)
    with pytest.raises(MultiModalInputError, match="not under"):
        load_image_url(f"file://{inside.parent}/../ok/../a.png", "x", str(inside.parent))


def test_undecodable_and_oversized_bytes():
    with pytest.raises(MultiModalInputError, match="not an image"):
        decode_image_bytes(b"GIF89a but not really", "p")
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (9000, 2)).save(buf, format="PNG")
    with pytest.raises(MultiModalInputError, match="9000x2"):
        decode_image_bytes(buf.getvalue(), "p")
