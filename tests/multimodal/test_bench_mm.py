"""`pagemill bench` with synthetic images (--dataset-name random-mm) on the tiny LLaVA: the dataset itself, `bench
throughput` (greedy tokens equal HF's for the same text and images; input tokens count the placeholders) and
`bench serve` against a real server through the chat endpoint."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from pagemill.benchmarks import datasets as D
from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.openai_client import build_payload
from pagemill.benchmarks.prompts import PromptBuilder
from tests.entrypoints.conftest import RemoteServer
from tests.multimodal.conftest import TOKENS_PER_IMAGE, hf_llava_greedy


@pytest.fixture(scope="module")
def builder(llava_hf):
    return PromptBuilder(llava_hf[1].tokenizer)


def test_random_mm_dataset_images_and_seed(builder):
    samples = D.random_mm_dataset(builder, 3, 10, 4, (40, 30), 2, seed=5)
    assert len(samples) == 3 and all(len(s.images) == 2 and s.prompt_len == 10 for s in samples)
    assert all(im.size == (40, 30) and im.mode == "RGB" for s in samples for im in s.images)
    pixels = [im.tobytes() for s in samples for im in s.images]
    assert len(set(pixels)) == 6  # every image its own
    again = D.random_mm_dataset(builder, 3, 10, 4, (40, 30), 2, seed=5)
    assert [im.tobytes() for s in again for im in s.images] == pixels
    assert D.parse_image_size("640x480") == (640, 480)
    for bad in ("640", "0x4", "ax3", "4x-1"):
        with pytest.raises(ValueError, match="--image-size"):
            D.parse_image_size(bad)
    with pytest.raises(ValueError, match="--images-per-prompt"):
        D.random_mm_dataset(builder, 1, 4, 4, (8, 8), -1)


def test_payload_carries_images_as_data_urls(builder):
    (sample,) = D.random_mm_dataset(builder, 1, 6, 3, (20, 10), 2, seed=1)
    body = build_payload(sample, "m", True, True, 0.0)
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"] and parts[2]["text"] == sample.prompt
    url = parts[1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert decoded.tobytes() == sample.images[1].tobytes()
    with pytest.raises(ValueError, match="chat endpoint"):
        build_payload(sample, "m", False, True, 0.0)


def _mm_args(model: str, *extra: str) -> list[str]:
    return ["--model", model, "--dataset-name", "random-mm", "--image-size", "48x40", "--num-prompts", "3",
            "--random-input-len", "12", "--random-output-len", "6", "--disable-tqdm", *extra]


def test_bench_throughput_random_mm_matches_hf(tiny_llava, llava_hf, tmp_path):
    from pagemill.benchmarks.throughput import measure_backends

    out = tmp_path / "tp.json"
    args = build_parser().parse_args(["bench", "throughput", *_mm_args(tiny_llava, "--images-per-prompt", "2"),
                                      "--dtype", "float32", "--max-model-len", "256", "--save-result", str(out)])
    args.func(args)
    ours = json.loads(out.read_text())["results"]["pagemill"]
    assert ours["total_output_tokens"] == ours["requested_output_tokens"] == 18
    samples = D.get_samples(args, llava_hf[1].tokenizer)
    text_tokens = sum(s.prompt_len for s in samples)
    # placeholders counted (16 per image), plus at most a BOS and the newline per prompt
    assert text_tokens + 3 * 2 * TOKENS_PER_IMAGE <= ours["total_input_tokens"] <= text_tokens + 3 * (32 + 4)
    _, outputs = measure_backends(args, tiny_llava, samples)
    for s, got in zip(samples, outputs["pagemill"]):
        assert got == hf_llava_greedy(llava_hf, "<image><image>\n" + s.prompt, list(s.images), 6)[1]
    with pytest.raises(ValueError, match="pagemill only"):
        bad = build_parser().parse_args(["bench", "throughput", *_mm_args(tiny_llava), "--compare", "hf"])
        measure_backends(bad, tiny_llava, samples)


def test_bench_serve_random_mm(tiny_llava, tmp_path_factory, tmp_path):
    srv = RemoteServer([tiny_llava, "--max-model-len", "256", "--kv-cache-memory", "16MiB",
                        "--disable-uvicorn-access-log"], tmp_path_factory.mktemp("mm_bench") / "server.log")
    try:
        srv.wait_healthy()
        result = tmp_path / "serve.json"
        common = ["bench", "serve", "--base-url", srv.url, "--num-prompts", "3", "--random-input-len", "8",
                  "--random-output-len", "4", "--dataset-name", "random-mm", "--images-per-prompt", "1",
                  "--image-size", "64x48", "--disable-tqdm", "--skip-initial-test"]
        with pytest.raises(ValueError, match="chat/completions"):
            args = build_parser().parse_args(common)
            args.func(args)
        args = build_parser().parse_args([*common, "--endpoint", "/v1/chat/completions", "--save-result",
                                          str(result)])
        args.func(args)
        (run,) = json.loads(result.read_text())["runs"]
        assert run["completed"] == 3 and run["failed"] == 0, run.get("error_samples")
        assert run["total_output_tokens"] == 12
        assert run["total_input_tokens"] > 3 * (8 + TOKENS_PER_IMAGE)  # the placeholders reach the usage counts
    finally:
        srv.stop()
