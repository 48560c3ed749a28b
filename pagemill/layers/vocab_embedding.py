"""The token embedding and the LM head, their vocabulary rows split over tensor-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.layers.linear import as_float_tensor
from pagemill.layers.quantization.base import copy_into
from pagemill.layers.quantization.dense import UnquantizedLinearMethod
from pagemill.layers.quantization.half_tiles import GGUF_FLOAT_DTYPES, HALF_KINDS


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this rank holds (equal shares; vLLM's vocabulary padding is not here)."""
    if vocab_size % tp_size:
        raise ValueError(f"a vocabulary of {vocab_size} does not split evenly over {tp_size} tensor-parallel ranks.")
    per_rank = vocab_size // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """Token ids -> embeddings from this rank's vocabulary rows (ids elsewhere give zeros, summed over ranks).

    A block-quantized GGUF table stays as the file's blocks (`blocks`, a view of the file map: no float copy) and
    its looked-up rows are decoded by the kernels with gguf.quants' arithmetic, the same float32 values a float
    table would hold; a float16 / bfloat16 table of a float32 model stays as stored (`half_table`) and its rows are
    widened when looked up; `weight` is then None. A table another layer reads as floats (`keep_float_table`, set by
    a tied float LM head) stays float, as does every quantized table without the kernels."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext) -> None:
        super().__init__()
        self.vocab_size, self.tp_size, self.tp_group = vocab_size, ctx.tp_size, ctx.tp_group
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, ctx.tp_rank, ctx.tp_size)
        self.hidden_size, self.dtype = hidden_size, ctx.dtype
        self.ops = ctx.ops  # the layer ops (the quantized table's row decoding: gguf_rows)
        self.keep_float_table = False
        self.blocks: torch.Tensor | None = None  # uint8 [rows, nb, bytes] when the table stays quantized
        self.ggml_type = 0
        self.half_table: torch.Tensor | None = None  # [rows, hidden] float16 / bfloat16: a 16-bit table as stored
        # Uncommitted until loaded (torch.empty maps pages lazily), dropped when the table stays quantized.
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size, dtype=ctx.dtype),
                                   requires_grad=False)

    def load_weight(self, param: str, loaded: Any, shard_id: Any = None) -> None:
        """This rank's rows of the checkpoint's [vocab, hidden] table (a GGUF block format: kept as blocks; float16
        / bfloat16 under a float32 model: kept as stored, widened per looked-up row)."""
        if self.weight is not None and not self.keep_float_table and self.dtype == torch.float32:
            if (self.ops is not None and getattr(loaded, "format", None) is not None
                    and self.ops.has_kernel("gguf_rows")):
                self.blocks = loaded.blocks[self.vocab_start:self.vocab_end]
                self.ggml_type = loaded.tensor.ggml_type
                self.weight = None
                return
            table = _half_table(loaded)
            if table is not None:
                self.half_table = table[self.vocab_start:self.vocab_end]
                self.weight = None
                return
        if self.weight is None:
            raise ValueError("the embedding table was loaded twice")
        if self.tp_size > 1:
            loaded = as_float_tensor(loaded)[self.vocab_start:self.vocab_end]
        copy_into(self.weight, loaded)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (local, in range) of this rank's table: [T, hidden]."""
        if self.half_table is not None:
            return F.embedding(ids, self.half_table).float()
        if self.blocks is None:
            return F.embedding(ids, self.weight)
        out = torch.empty(ids.shape[0], self.hidden_size, dtype=torch.float32)
        self.ops.gguf_rows(out, self.blocks, self.ggml_type, ids.to(torch.int64).contiguous())
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden]."""
        if self.tp_size == 1:
            return self.lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = self.lookup(torch.where(mine, input_ids - self.vocab_start, 0))
        out.masked_fill_(~mine[:, None], 0)
        self.tp_group.all_reduce(out)
        return out


def _half_table(loaded: Any) -> torch.Tensor | None:
    """A float16 / bfloat16 checkpoint table in its stored dtype (a view of the file), else None."""
    if isinstance(loaded, torch.Tensor):
        return loaded if loaded.dtype in HALF_KINDS else None
    if getattr(loaded, "tensor", None) is not None and GGUF_FLOAT_DTYPES.get(loaded.tensor.ggml_type) in HALF_KINDS:
        return loaded.stored_values()
    return None


class ParallelLMHead(nn.Module):
    """Hidden states -> logits over this rank's vocabulary rows, through a linear method (GGUF records, prepacked
    or plain float). Tied to the embedding, it reads the embedding's weight: shared when its method is plain float
    in the model dtype, else its own copy in the method's form."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext, checkpoint_name: str,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, ctx.tp_rank, ctx.tp_size)
        self.tp_size, self.tp_group = ctx.tp_size, ctx.tp_group
        self.quant_method = ctx.quant_config.get_linear_method([checkpoint_name], hidden_size)
        self.bias = None
        self.shares_embedding = (tied_to is not None and type(self.quant_method) is UnquantizedLinearMethod
                                 and self.quant_method.input_dtype == ctx.dtype)
        if self.shares_embedding:
            tied_to.keep_float_table = True
            self.weight = tied_to.weight
        else:
            self.quant_method.create_weights(self, hidden_size, self.vocab_end - self.vocab_start)
        self._tied = (tied_to,)  # a tuple: not registered as a submodule

    @property
    def weight_format(self) -> str:
        """How the method stores the weight (float32, q8_0, ...)."""
        return self.quant_method.weight_format

    def load_weight(self, param: str, loaded: Any, shard_id: Any = None) -> None:
        """This rank's rows of the checkpoint's [vocab, hidden] table (a no-op when it shares the embedding's)."""
        if self.shares_embedding:
            return
        if self.tp_size > 1:
            loaded = as_float_tensor(loaded)[self.vocab_start:self.vocab_end]
        self.quant_method.load_weight(self, loaded, 0, 0)

    def expected_weights(self) -> set[tuple[str, Any]]:
        """The weight, unless it is the embedding's."""
        return set() if self.shares_embedding else {("weight", None)}

    def process_weights_after_loading(self) -> None:
        """The method's form of the weight (nothing to do when shared)."""
        if self.shares_embedding:
            self.weight = self._tied[0].weight  # the table as loaded
        else:
            self.quant_method.process_weights_after_loading(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the hidden states' dtype (gathered over ranks)."""
        logits = self.quant_method.apply(self, hidden).to(hidden.dtype)
        if self.tp_size > 1:
            logits = self.tp_group.all_gather(logits)
        return logits
