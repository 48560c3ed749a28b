"""Streaming OpenAI-compatible client: request bodies and one timed streaming request."""

from __future__ import annotations

import json
import time
from typing import Any

from pagemill.benchmarks.datasets import SampleRequest
from pagemill.benchmarks.metrics import RequestResult


def image_data_url(image: Any) -> str:
    """A PIL image as a base64 PNG data URL (an OpenAI `image_url` part's url)."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def build_payload(sample: SampleRequest, model: str, chat: bool, ignore_eos: bool,
                  temperature: float, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of one streaming completion or chat-completion request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": sample.expected_output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if chat:
        content: Any = sample.prompt
        if sample.images:
            content = [*({"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in sample.images),
                       {"type": "text", "text": sample.prompt}]
        body["messages"] = [{"role": "user", "content": content}]
        body["max_completion_tokens"] = sample.expected_output_len
    else:
        if sample.images:
            raise ValueError("requests with images need the chat endpoint (--endpoint /v1/chat/completions).")
        body["prompt"] = sample.prompt
    body.update(extra_body or {})
    return body


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(session: Any, url: str, payload: dict[str, Any], prompt_len: int,
                       chat: bool) -> RequestResult:
    """POST one streaming request and record the arrival time of every chunk carrying text.

    Output tokens come from the final `usage` chunk when the server sends one, else one per
    chunk. Any HTTP, protocol or server error marks the request failed instead of raising.
    """
    result = RequestResult(send_time=time.perf_counter(), prompt_len=prompt_len)
    usage_tokens: int | None = None
    texts: list[str] = []
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return result
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:500]
                    return result
                for choice in chunk.get("choices") or []:
                    text = _chunk_text(choice, chat)
                    if text:
                        result.chunk_times.append(now)
                        texts.append(text)
                        break
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens"):
                        result.prompt_len = int(usage["prompt_tokens"])
    except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.generated_text = "".join(texts)
    result.output_tokens = usage_tokens if usage_tokens is not None else len(result.chunk_times)
    result.success = bool(result.chunk_times)
    if not result.success:
        result.error = "stream ended without any generated text"
    return result
