"""Triton 3.6's interpreter under NumPy >= 2.4: loops with a run-time bound.

The interpreter (TRITON_INTERPRET=1) holds a kernel's scalar arguments as one-element arrays,
and Triton 3.6 turns one into a Python int, for `range(0, k_size, BLOCK_K)`, by
`int(handle.data)`. NumPy 2.4 refuses that for an array of one dimension ("only 0-dimensional
arrays can be converted to Python scalars"), so every kernel whose loop bound is an argument
fails there. Later Triton (3.9) reads `int(handle.data.squeeze())`. `apply()` gives the 3.6
interpreter that same conversion; on a Triton whose interpreter already squeezes, or has no
such hook, it changes nothing. It touches only the interpreter, which compiled kernels never
use.
"""

from __future__ import annotations

import inspect


def _index(self) -> int:
    return int(self.handle.data.squeeze())


def installed():
    """The installed triton.runtime.interpreter, or None for a Triton without one."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without an interpreter
        return None
    return interpreter


def needed(interpreter) -> bool:
    """Whether `interpreter` (triton.runtime.interpreter) converts scalars with the bare
    `int(self.handle.data)`."""
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_moegraph_index", False):
        return False
    try:
        source = inspect.getsource(patch)
    except (OSError, TypeError):
        return False
    return "int(self.handle.data)" in source


def apply(interpreter=None) -> bool:
    """Wrap the tensor patching of `interpreter` (default: triton.runtime.interpreter) so that
    `__index__` squeezes first; True if it was needed (and done)."""
    interpreter = interpreter or installed()
    if interpreter is None or not needed(interpreter):
        return False
    patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patch_lang_tensor._moegraph_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
