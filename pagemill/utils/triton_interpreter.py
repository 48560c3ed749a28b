"""Running Triton kernels on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`, read when kernels are defined)."""

from __future__ import annotations


def patch_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with `int(array)`, which numpy >= 2.4 refuses for its
    one-element arrays (so loops bounded by a loaded value fail); convert with the element instead. Idempotent."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_pagemill_scalars", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagemill_scalars = True
    interpreter._patch_lang_tensor = patched
