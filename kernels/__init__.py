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
    def _interpreter_compat():
        """Under TRITON_INTERPRET (set before Triton decorates a kernel), give Triton 3.6's
        interpreter NumPy 2.4's scalar conversion (interpreter_compat.py)."""
        import os
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            from .interpreter_compat import apply
            apply()

    _interpreter_compat()
    del _interpreter_compat
