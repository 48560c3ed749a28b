"""Build a model with its layers' methods chosen from the engine's options and the checkpoint, then load it."""

from __future__ import annotations

import logging
import time

from torch import nn

from pagemill.attention.backend import AttentionBackend
from pagemill.config import CHECKPOINT_QUANTIZATIONS, ModelConfig
from pagemill.distributed.parallel_state import ParallelContext
from pagemill.kernels.ops import TorchLayerOps
from pagemill.layers.context import LayerContext
from pagemill.layers.quantization import get_quant_config
from pagemill.layers.quantization.records_cache import RecordsCache
from pagemill.layers.quantization.weight_memory import weight_memory_line
from pagemill.models.registry import get_model_class
from pagemill.utils.memory import release_free_memory

logger = logging.getLogger(__name__)


def load_model(model_config: ModelConfig, ops: TorchLayerOps, attn_backend: AttentionBackend,
               parallel: ParallelContext | None = None) -> nn.Module:
    """Instantiate the registered class for the model (its layers built with `ops`, `attn_backend` and the linear
    methods the checkpoint calls for; this rank's share of it under tensor / pipeline parallelism) and load its
    weights."""
    from pagemill.loader.gguf_loader import GGUFWeights
    from pagemill.loader.safetensors_loader import checkpoint_dtypes, iter_hf_weights, safetensors_files

    cls = get_model_class(model_config.mm_hf_config or model_config.hf_config)
    start = time.perf_counter()
    gguf = GGUFWeights(model_config.gguf_file, model_config.hf_config) if model_config.gguf_file else None
    p = parallel or ParallelContext()
    layout = f"tp{p.tp_rank}/{p.tp_size},pp{p.pp_rank}/{p.pp_size},{ops.isa()}"
    records_cache = (RecordsCache.for_weight_file(model_config.gguf_file, layout)
                     if gguf is not None and ops.linear_kernels else None)
    checkpoint = None
    if model_config.quantization in CHECKPOINT_QUANTIZATIONS:
        from pagemill.loader.quantized_checkpoint import QuantizedCheckpoint

        checkpoint = QuantizedCheckpoint(model_config.model, getattr(model_config.hf_config, "quantization_config",
                                                                     None))
        if ops.linear_kernels:
            records_cache = checkpoint.records_cache(layout)
    elif gguf is None and ops.linear_kernels:  # 16-bit tiles, weight-only int8 / int4 records
        records_cache = RecordsCache.for_weight_files(safetensors_files(model_config.model),
                                                      f"{layout},{model_config.quantization or 'float'}")
    quant_config = get_quant_config(model_config.linear_dtype, model_config.quantization, model_config.dtype,
                                    ops, gguf.tensor_types() if gguf is not None else None, records_cache,
                                    checkpoint, checkpoint_dtypes(model_config.model) if gguf is None else None)
    ctx = LayerContext(model_config.dtype, model_config.max_model_len, ops, quant_config, attn_backend,
                       p.tp_rank, p.tp_size, p.tp_group, p.pp_rank, p.pp_size)
    model = cls(model_config.mm_hf_config or model_config.hf_config, ctx)
    # GGUF tensors are decoded (or their blocks laid out) straight into the layers: no float temporaries.
    if gguf is not None:
        weights = gguf.lazy()
    elif checkpoint is not None:  # each quantized linear's tensors decoded into one weight
        weights = checkpoint.weights(iter_hf_weights(model_config.model))
    else:
        weights = iter_hf_weights(model_config.model)
    model.load_weights(weights)
    model.eval().requires_grad_(False)
    release_free_memory()  # the load's freed temporaries: the step buffers' mallopt keeps freed heap pages mapped
    if gguf is not None:
        gguf.gguf.release_pages()  # the file no longer counts in the resident set
    if records_cache is not None:
        if records_cache.mapped:
            logger.info("Records mapped from %s (%d layers, no packing)", records_cache.path, records_cache.hits)
        records_cache.save()
    logger.info("Loaded %s (%s, %s) in %.1fs; %s", cls.__name__, model_config.dtype, type(quant_config).__name__,
                time.perf_counter() - start, weight_memory_line(model))
    if gguf is not None:
        from pagemill.layers.quantization.gguf_report import weight_format_lines

        for line in weight_format_lines(model):
            logger.info("GGUF weights: %s", line)
    return model
