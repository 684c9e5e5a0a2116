"""Triton's interpreter: the language patched once a launch, not once a helper call.

Under TRITON_INTERPRET=1 a kernel launch (the interpreter's GridExecutor) swaps
triton.language's builtins for interpreted ones with `_patch_lang(fn)` and puts them back after
the grid. Every call of a @triton.jit helper from inside the kernel (InterpretedFunction's
`__call__`) runs `_patch_lang` again, though the launch's replacements are still in place: it
walks every member of triton.language, of its tensor class and of its math module (about 2 ms
on the CPU) and sets replacements that behave as the ones already set (builtins already
replaced are skipped; the rest get new functions of the same code). The expert kernels call
helpers inside their loops, so on the CPU a quarter of a model test's time went there
(Triton 3.6 and 3.9 alike).

`apply()` marks each launch live while it runs (wrapping `GridExecutor.__call__`) and makes
`_patch_lang` return at once, with nothing to restore, where the live launch has already
patched every language module the function sees (`triton.language`, `triton.language.core`);
the launch's own patching, anything outside a launch and a helper that sees another module
patch as before. It touches only the interpreter, which compiled kernels never use.
"""

from __future__ import annotations

from .interpreter_compat import installed


class _Launch:
    """A live launch: the language modules patched while it runs (its own patching first)."""

    def __init__(self) -> None:
        self.patched: frozenset[int] | None = None  # None until the launch's own patching


_live: list[_Launch] = []  # innermost last


class _Kept:
    """The scope of a call whose patches were already in place: nothing to restore."""

    def restore(self) -> None:
        pass


def needed(interpreter) -> bool:
    """Whether `interpreter` (triton.runtime.interpreter) has the per-call patching this
    replaces, and it is not replaced yet."""
    patch = getattr(interpreter, "_patch_lang", None)
    tl = getattr(interpreter, "tl", None)
    grid = getattr(interpreter, "GridExecutor", None)
    return (callable(patch) and not getattr(patch, "_moegraph_once", False)
            and getattr(tl, "core", None) is not None and callable(getattr(grid, "__call__", None)))


def apply(interpreter=None) -> bool:
    """Wrap `_patch_lang` and the launch (`GridExecutor.__call__`) of `interpreter` (default:
    triton.runtime.interpreter); True if done."""
    interpreter = interpreter or installed()
    if interpreter is None or not needed(interpreter):
        return False
    patch, tl, grid = interpreter._patch_lang, interpreter.tl, interpreter.GridExecutor
    langs = frozenset((id(tl), id(tl.core)))
    run_grid = grid.__call__

    def seen_by(fn) -> frozenset[int]:
        return langs.intersection(map(id, fn.__globals__.values()))

    def patch_lang(fn):
        live = _live[-1] if _live else None
        seen = seen_by(fn)
        if live is not None and live.patched is not None and seen and seen <= live.patched:
            return _Kept()
        scope = patch(fn)
        if live is not None:  # the launch's own patching, or a helper seeing more modules
            live.patched = seen | (live.patched or frozenset())
        return scope

    def launch(self, *args, **kwargs):
        _live.append(_Launch())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            _live.pop()

    patch_lang._moegraph_once = True
    interpreter._patch_lang = patch_lang
    grid.__call__ = launch
    return True
