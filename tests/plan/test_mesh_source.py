"""per_parameter_mesh (distributed/layout.py) answers from FSDP2's source where torch is not
imported yet, so `moegraph plan --nproc W --ep P` (1 < P < W) needs no torch import; the
source's answer is the import's."""

import subprocess
import sys

import pytest
import torch  # noqa: F401  (the import's answer below needs it loaded)

from moegraph_cli.distributed import layout


def test_the_source_answer_is_the_imports():
    assert "torch" in sys.modules  # so the cached function takes the import path
    by_import = layout.per_parameter_mesh.__wrapped__()
    assert layout._mesh_in_source() is by_import


@pytest.mark.parametrize("text,want", [
    ("class FSDPMeshInfo(X):\n    pass\nclass ShardPlacementResult:\n    pass\n", True),
    ("class FSDPMeshInfo(X):\n    pass\n", False),  # a torch before per-parameter meshes
    (None, None),  # no such file: the import answers
])
def test_source_of_a_given_torch(tmp_path, text, want):
    if text is not None:
        path = tmp_path.joinpath(*layout.FSDP_COMMON)
        path.parent.mkdir(parents=True)
        path.write_text(text)
    assert layout._mesh_in_source(str(tmp_path)) is want


def test_plan_side_asks_without_importing_torch():
    code = ("import sys; from moegraph_cli.distributed.layout import per_parameter_mesh; "
            "a = per_parameter_mesh(); print(a, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == [str(layout.per_parameter_mesh.__wrapped__()), "False"], out


def test_a_distributed_plan_imports_no_torch():
    code = ("import contextlib, io, sys\n"
            "from moegraph_cli.app import main\n"
            "sys.argv = ['moegraph', 'plan', '-p', 'tiny-deepseek-v3', '--budget', '1GiB',\n"
            "            '--nproc', '4', '--ep', '2', '--json']\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            "        main()\n"
            "    except SystemExit as e:\n"
            "        assert not e.code, e.code\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"], out.stdout
