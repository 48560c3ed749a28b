"""A copy of a GGUF file with its 2-D weights re-encoded (requantized, or stored as F16 / BF16): the same metadata,
the weights' values dequantized by gguf.quants and handed to an encoder."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# float32 [rows, columns] -> (the tensor's new data, its ggml type), or None: keep the tensor as it is
Encoder = Callable[[np.ndarray], "tuple[np.ndarray, int] | None"]


def rewrite_weights(src: str, dst: str, encode: Encoder) -> None:
    """Write `dst`: `src`'s metadata and tensors, each 2-D weight as `encode` gives it."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    for t in reader.tensors:
        shape = [int(v) for v in reversed(t.shape)]  # rows, columns
        encoded = None
        if len(shape) == 2:
            encoded = encode(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
        if encoded is None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(t.name, encoded[0], raw_dtype=encoded[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def to_float_gguf(src: str, dst: str, ggml_type: int) -> None:
    """`src` with every 2-D weight stored as F16 (ggml type 1) or BF16 (30), rounded from its float32 values."""
    from gguf.quants import quantize

    rewrite_weights(src, dst, lambda w: (quantize(w, ggml_type), ggml_type))
