"""kernels/interpreter_compat.py: Triton 3.6's interpreter turns a one-element scalar array
into an int the way NumPy 2.4 refuses; the shim makes it squeeze first, and leaves a fixed
interpreter alone."""

import operator
import os
import types

import numpy as np
import pytest

from moegraph_kernels import interpreter_compat


def _bare_patch(tensor, scope):  # Triton 3.6's conversion
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))


def _squeezing_patch(tensor, scope):  # Triton 3.9's
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


class _Scope:
    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append(name)
        setattr(obj, name, value)


def _scalar_class():
    class Scalar:  # what the interpreter makes of a kernel's scalar argument
        def __init__(self, value):
            self.handle = types.SimpleNamespace(data=np.array([value], dtype=np.int32))
    return Scalar


def test_the_bare_conversion_is_wrapped_to_squeeze():
    interp = types.SimpleNamespace(_patch_lang_tensor=_bare_patch)
    assert interpreter_compat.needed(interp)
    assert interpreter_compat.apply(interp)
    scalar = _scalar_class()
    scope = _Scope()
    interp._patch_lang_tensor(scalar, scope)
    assert operator.index(scalar(32)) == 32
    assert list(range(0, scalar(96), 32)) == [0, 32, 64]
    # applied once: a second apply sees its own wrapper and does nothing
    assert not interpreter_compat.needed(interp) and not interpreter_compat.apply(interp)


def test_a_squeezing_interpreter_is_left_alone():
    interp = types.SimpleNamespace(_patch_lang_tensor=_squeezing_patch)
    assert not interpreter_compat.needed(interp)
    assert not interpreter_compat.apply(interp)
    assert interp._patch_lang_tensor is _squeezing_patch


def test_an_interpreter_without_the_hook_is_left_alone():
    assert not interpreter_compat.needed(types.SimpleNamespace())


def test_the_installed_interpreter_runs_a_run_time_loop_bound():
    """The installed Triton's interpreter (shimmed where it needs it) runs a kernel whose
    loop bound is an argument, as every expert kernel's K loop is."""
    import torch
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

    @triton.jit
    def row_sums(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, n, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr, tl.sum(acc, axis=0))

    x = torch.arange(20, dtype=torch.float32)
    out = torch.zeros(1)
    row_sums[(1,)](x, out, x.numel(), BLOCK=8)
    assert out.item() == float(x.sum())
