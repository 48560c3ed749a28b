"""pagemill: a vLLM-class LLM inference and serving engine for CPUs."""

from pagemill.platforms import current_platform as _platform

# Before anything loads torch: the device's process-wide settings (on the CPU, OpenMP threads that sleep when idle).
_platform.set_up_process_env()

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
        from pagemill.engine.arg_utils import EngineArgs
        return EngineArgs
    if name == "LLMEngine":
        from pagemill.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
