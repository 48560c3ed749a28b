"""Structured output through AsyncLLM: the engine core runs in its own process (params over msgpack, the core
loads its own tokenizer for the grammars), bad constraints fail before they are queued."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.async_llm import AsyncLLM
from pagemill.sampling_params import SamplingParams, StructuredOutputsParams
from tests.structured_output.conftest import chat_prompt


@pytest.mark.slow
def test_async_engine_core_process():
    engine = AsyncLLM.from_engine_args(EngineArgs(kv_cache_memory="64MiB", max_model_len=512,
                                                  structured_outputs_backend="guidance"))

    async def collect(rid: str, prompt: str, params: SamplingParams):
        return [out async for out in engine.generate(prompt, params, rid)][-1]

    async def main():
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["name", "age"], "additionalProperties": False}
        json_out, choice_out = await asyncio.gather(
            collect("j", chat_prompt("A person as JSON."), SamplingParams(
                temperature=0, max_tokens=128, structured_outputs=StructuredOutputsParams(json=schema))),
            collect("c", chat_prompt("Yes or no?"), SamplingParams(
                temperature=0, max_tokens=8, guided_decoding=StructuredOutputsParams(choice=["yes", "no"]))))
        assert set(json.loads(json_out.outputs[0].text)) == {"name", "age"}
        assert json_out.outputs[0].finish_reason == "stop"
        assert choice_out.outputs[0].text in ("yes", "no")
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            await collect("bad", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(")))
        stats = await engine.get_scheduler_stats()
        assert stats["num_blocks_free"] == stats["num_blocks_total"]

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
