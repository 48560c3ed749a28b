"""LoRA on the GPU worker and runner, run on the CPU (device="cpu", Triton attention and layer ops through Triton's
interpreter): adapters of different ranks and targets next to the base model in one batch give HF + PEFT's greedy
tokens, and a constrained (structured-output) request in the same engine keeps to its choices."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagemill import LLM, SamplingParams  # noqa: E402
from pagemill.sampling_params import StructuredOutputsParams  # noqa: E402
from tests.lora.conftest import hf_peft_greedy  # noqa: E402
from tests.lora.test_lora_models import PROMPTS, lora_requests, run_mixed  # noqa: E402

GPU_ARGS = dict(attention_backend="triton", worker_cls="pagemill.worker.gpu_worker.GpuWorker", device="cpu")


def test_adapters_on_the_gpu_runner_equal_hf_peft(tiny_models, llama_adapters, smol_hf) -> None:
    base = tiny_models["llama"]
    tok = smol_hf[1]
    prompts = [tok.encode(t) for t in PROMPTS[:2]]
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3, kv_cache_memory="64MiB",
              **GPU_ARGS)
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    assert type(runner).__name__ == "GpuModelRunner" and runner.lora_manager is not None
    loras = [None, *lora_requests(llama_adapters[:2])]
    got = run_mixed(llm, prompts, loras)
    assert got == [hf_peft_greedy(base, lo and lo.lora_path, p, 10) for lo in loras for p in prompts]
    assert len({tuple(g) for g in got}) == len(got)  # each adapter changes the output
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    out = llm.generate(["Is the sky blue?"], choice, use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no", "maybe")
