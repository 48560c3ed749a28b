"""pagemill: a vLLM-class LLM inference and serving engine for CPUs."""

import os as _os

# OpenMP threads that spin while waiting lose badly whenever anything else needs a core (the API server,
# a load generator, the tokenizer): measured 3-6x lower throughput on 2 cores. Sleep instead — but only
# after a short spin (GOMP_SPINCOUNT): a decode step runs ~200 parallel regions microseconds apart, and
# waking a sleeping thread for each cost 20% of a single-stream step. These must be set before torch loads
# its OpenMP runtime; the user's own settings win.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from pagemill.lora.request import LoRARequest
from pagemill.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagemill.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from pagemill.pooling_params import PoolingParams
from pagemill.sampling_params import (GuidedDecodingParams, RequestOutputKind, SamplingParams,
                                      StructuredOutputsParams)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "EngineArgs", "LLMEngine", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "StructuredOutputsParams",
           "GuidedDecodingParams", "LoRARequest", "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "__version__"]


def __getattr__(name: str):
    # Import the engine lazily so that `import pagemill` stays light (no torch/transformers until needed).
    if name == "LLM":
        from pagemill.llm import LLM
        return LLM
    if name == "EngineArgs":
        from pagemill.config import EngineArgs
        return EngineArgs
    if name == "LLMEngine":
        from pagemill.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
