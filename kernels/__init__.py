"""moegraph's Triton kernels, installed as the package `moegraph_kernels` (pyproject.toml).

Imported under the name `kernels` this directory is an accident: the repository root is first
on sys.path (`python -m pytest` or `python -m moegraph_cli.app` run from a checkout), and the
directory hides any installed distribution of that name -- transformers >= 5.25 requires one
(the `kernels` hub package) and imports names from it. Found that way, this module hands the
name to the installed package when there is one, and stays an empty module otherwise (what an
`import kernels` found here always was).
"""

if __name__ == "kernels":
    def _hand_over():
        """Import `kernels` with the repository root off sys.path: found, it takes this
        module's place in sys.modules (which the import statement returns); not found, this
        module goes back."""
        import importlib
        import sys
        from pathlib import Path

        root = Path(__file__).resolve().parent.parent
        here = sys.modules.pop(__name__)
        saved = sys.path[:]
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
        try:
            importlib.import_module("kernels")
        except ImportError:
            sys.modules["kernels"] = here
        finally:
            sys.path[:] = saved

    _hand_over()
    del _hand_over
else:
    from .env import interpreting as _interpreting

    if _interpreting():  # Triton 3.6's interpreter under NumPy 2.4 (interpreter_compat.py),
        # and the language patched once a launch (interpreter_patch_once.py)
        from .interpreter_compat import apply as _apply
        from .interpreter_patch_once import apply as _apply_once
        _apply()
        _apply_once()
