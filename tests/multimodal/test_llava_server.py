"""`pagemill serve` of the tiny LLaVA: the openai SDK with a base64 image gets HF's greedy reply; every bad image
is a 400 naming the field; the server stays healthy."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer
from tests.multimodal.conftest import hf_llava_greedy, make_image

MODEL = "tiny-llava"


def data_url(image, fmt: str = "PNG", mime: str = "image/png") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def chat_body(urls: list[str], text: str = "What is in the picture?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_llava, tmp_path_factory):
    srv = RemoteServer([tiny_llava, "--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", "256",
                        "--kv-cache-memory", "16MiB", "--limit-mm-per-prompt", '{"image": 2}',
                        "--disable-uvicorn-access-log"], tmp_path_factory.mktemp("llava") / "server.log")
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    yield srv
    assert srv.stop() in (0, -15), srv.log_tail()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def test_openai_sdk_base64_image_matches_hf(server, llava_hf):
    image = make_image(7)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    resp = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": "What is in the picture?"}]}])
    tok = llava_hf[1].tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is in the picture?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids, ref = hf_llava_greedy(llava_hf, text, [image], 8, add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)


def _tiff() -> str:
    return data_url(make_image(1), "TIFF", "image/tiff")


def _truncated_png() -> str:
    buf = io.BytesIO()
    make_image(2, (64, 64)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()[:400]).decode()


def _png_of_size(w: int, h: int) -> str:
    from PIL import Image

    return data_url(Image.new("RGB", (w, h)))


BAD = [  # (case, image URLs, the param, text in the message)
    ("bad-base64", ["data:image/png;base64,@@@not base64@@@"], "messages.0.content.0.image_url", "base64"),
    ("not-an-image", ["data:image/png;base64," + base64.b64encode(b"hello, not an image").decode()],
     "messages.0.content.0.image_url", "not an image"),
    ("truncated-png", [_truncated_png()], "messages.0.content.0.image_url", "could not be decoded"),
    ("unsupported-format", [_tiff()], "messages.0.content.0.image_url", "TIFF"),
    ("not-image-mime", ["data:text/plain;base64,aGVsbG8="], "messages.0.content.0.image_url", "text/plain"),
    ("oversized", [_png_of_size(9000, 4)], "messages.0.content.0.image_url", "9000x4"),
    ("too-many", [_png_of_size(8, 8)] * 3, "messages.0.content.2.image_url", "at most 2"),
    ("file-url-refused", ["file:///etc/hostname"], "messages.0.content.0.image_url", "allowed-local-media-path"),
    ("bad-scheme", ["ftp://example.com/a.png"], "messages.0.content.0.image_url", "scheme"),
]


@pytest.mark.parametrize("urls,param,text", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_image_is_400_naming_the_field(http, urls, param, text):
    r = http.post("/v1/chat/completions", json=chat_body(urls))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert text in err["message"], err


def test_still_healthy_after_bad_images(http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json=chat_body([data_url(make_image(3))]))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8 or r.json()["choices"][0]["finish_reason"] == "stop"


def test_tokenize_refuses_image_parts(http):
    body = chat_body([data_url(make_image(4))])
    del body["max_tokens"], body["temperature"]
    r = http.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.content.0"
