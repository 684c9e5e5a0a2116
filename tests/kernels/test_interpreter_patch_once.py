"""kernels/interpreter_patch_once.py: inside a live launch, a helper's call does not patch
triton.language again; the launch's own patching, calls outside a launch and a helper that
sees a module the launch did not patch do; nothing is left live after a launch, even one that
fails. Then the same on Triton's real interpreter."""

import os
import types

import pytest
import torch

from moegraph_kernels import interpreter_patch_once as once


def _fake():
    """An interpreter module with a counting `_patch_lang` and a GridExecutor that patches,
    runs its body (`fn.body`) and restores, as Triton's does; `fn(name, **globals)` makes a
    function whose globals see what is given."""
    core = types.ModuleType("core")
    tl = types.ModuleType("language")
    tl.core = core
    log = []

    class Scope:
        def restore(self):
            log.append("restore")

    def patch_lang(fn):
        log.append(fn.__name__)
        return Scope()

    class GridExecutor:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self):
            scope = interp._patch_lang(self.fn)
            try:
                self.fn.body()
            finally:
                scope.restore()

    interp = types.SimpleNamespace(_patch_lang=patch_lang, tl=tl, GridExecutor=GridExecutor)

    def fn(name, body=lambda: None, **seen):
        f = types.FunctionType((lambda: None).__code__, dict(seen), name)
        f.body = body
        return f
    return interp, log, fn, tl, core


def test_a_helper_inside_a_launch_does_not_patch_again():
    interp, log, fn, tl, core = _fake()
    assert once.needed(interp) and once.apply(interp)
    helper = fn("helper", tl=tl)
    interp._patch_lang(helper)  # outside a launch: patches (a scope nobody restores)
    assert log == ["helper"]

    def body():
        for _ in range(3):
            interp._patch_lang(helper).restore()  # kept: nothing patched or restored
    interp.GridExecutor(fn("kernel", body, tl=tl))()
    assert log == ["helper", "kernel", "restore"] and once._live == []
    interp._patch_lang(helper)  # after the launch: patches again
    assert log[-1] == "helper"
    # applied once: a second apply sees its own wrapper
    assert not once.needed(interp) and not once.apply(interp)


def test_a_module_the_launch_did_not_patch_is_patched_then_kept():
    interp, log, fn, tl, core = _fake()
    once.apply(interp)

    def body():
        interp._patch_lang(fn("sees_core", core=core))  # the launch saw tl only
        interp._patch_lang(fn("sees_both", tl=tl, lang=core))  # now both are patched
        interp._patch_lang(fn("sees_none"))  # no language module: as before
    interp.GridExecutor(fn("kernel", body, tl=tl))()
    assert log == ["kernel", "sees_core", "sees_none", "restore"] and once._live == []


def test_a_failing_launch_leaves_nothing_live():
    interp, log, fn, tl, core = _fake()
    once.apply(interp)

    def body():
        raise ValueError("kernel failed")
    with pytest.raises(ValueError):
        interp.GridExecutor(fn("kernel", body, tl=tl))()
    assert once._live == [] and log == ["kernel", "restore"]
    interp.GridExecutor(fn("kernel", tl=tl))()  # the next launch patches its own
    assert log[-2:] == ["kernel", "restore"]


def test_an_interpreter_without_the_hooks_is_left_alone():
    assert not once.needed(types.SimpleNamespace())
    assert not once.apply(types.SimpleNamespace(_patch_lang=lambda fn: None))


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    import triton
    import triton.language as tl

    @triton.jit
    def _twice(x):
        return x * 2

    @triton.jit
    def _loop_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(0, n):
            acc = _twice(acc + tl.load(x_ptr + offs))
        tl.store(y_ptr + offs, acc)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                    reason="the interpreter's own launch")
def test_the_real_interpreter_patches_once_a_launch_and_restores():
    import triton.language as tl
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "_moegraph_once", False)
    # one patching walks tl.core.tensor_descriptor_base once, whatever modules it patches
    calls, patchings = [], []
    inner, walk = interpreter._patch_lang, interpreter._patch_builtin
    interpreter._patch_lang = lambda fn: calls.append(fn.__name__) or inner(fn)
    interpreter._patch_builtin = lambda pkg, *a: (
        patchings.append(1) if pkg is tl.core.tensor_descriptor_base else None) or walk(pkg, *a)
    try:
        x = torch.arange(8, dtype=torch.float32)
        y = torch.empty_like(x)
        _loop_kernel[(3,)](x, y, 4, BLOCK=8)
    finally:
        interpreter._patch_lang, interpreter._patch_builtin = inner, walk
    assert torch.equal(y, (((x * 2 + x) * 2 + x) * 2 + x) * 2)
    assert calls.count("_loop_kernel") == 1 and calls.count("_twice") == 12  # asked 12 times
    # the launch's own patching, and at most one more for triton.language's own jit helpers
    # (tl.zeros: their module sees tl.core too); without the shim every call patched again
    assert 1 <= len(patchings) <= 2, len(patchings)
    assert once._live == []
    assert tl.core.is_builtin(tl.load)  # the launch's replacements are gone
