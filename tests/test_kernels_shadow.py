"""The repository's kernels/ directory, found as a top-level `kernels` (the checkout first on
sys.path, as under `python -m pytest`), must not hide an installed package of that name:
transformers >= 5.25 imports names from the `kernels` hub package it requires."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, env_path: str | None = None) -> str:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if env_path:
        env["PYTHONPATH"] = env_path
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_an_installed_kernels_package_wins_over_the_checkout(tmp_path):
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("MARK = 'installed'\n")
    # cwd (the checkout) first, then the "installed" package, as with `python -m` from ROOT
    got = _run("import sys; sys.path.insert(0, ''); import kernels; "
               "print(kernels.MARK, kernels.__file__)", str(tmp_path))
    mark, path = got.split(" ", 1)
    assert mark == "installed" and Path(path).resolve() == (fake / "__init__.py").resolve()


def test_without_one_the_checkout_directory_stays_an_empty_module():
    code = (f"import sys; sys.path[:] = [{str(ROOT)!r}] + "
            "[p for p in sys.path[1:] if 'site-packages' not in p and 'dist-packages' not in p]; "
            "import kernels; print(kernels.__file__, [n for n in dir(kernels) "
            "if not n.startswith('__')])")
    path, names = _run(code).split(" ", 1)
    assert Path(path).resolve() == (ROOT / "kernels" / "__init__.py").resolve()
    assert names == "[]"


def test_moegraph_kernels_is_unaffected():
    got = _run("import sys; sys.path.insert(0, ''); import kernels, moegraph_kernels.rmsnorm; "
               "print(moegraph_kernels.__name__, 'rmsnorm' in dir(moegraph_kernels))")
    assert got == "moegraph_kernels True"
