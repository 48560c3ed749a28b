"""Objects named by import path ("package.module.Name"), so that a lower layer can name a class above it without
importing it (vLLM's `resolve_obj_by_qualname`)."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_obj_by_qualname(qualname: str) -> Any:
    """The object `qualname` names: "pagemill.attention.backends.torch_paged.TorchPagedAttention" -> the class."""
    module_name, _, obj_name = qualname.rpartition(".")
    if not module_name:
        raise ValueError(f"not a qualified name (package.module.Name): {qualname!r}")
    return getattr(importlib.import_module(module_name), obj_name)
