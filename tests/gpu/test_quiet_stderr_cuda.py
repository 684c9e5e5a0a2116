"""A GPU command's stderr holds its own messages only: `verify`, `capture` and `profile` on the
tiny default print no warning of torch's (cuBLAS's "no current CUDA context" from autograd's
thread, an empty graph at capture_end, the profiler's note on cycles: the filters of
commands/cli_run.py TORCH_NOISE). Each runs the installed entry point in a fresh process, a
few short steps, and must exit 0."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parents[2]
SHORT = ["--set", "run.seq_len=256", "--set", "run.warmup=1"]


def _moegraph(*args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MOEGRAPH_ERROR_DIR",
                        "MOEGRAPH_DEBUG", "PYTHONWARNINGS")}
    return subprocess.run([sys.executable, "-m", "moegraph_cli.app", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args", [
    ["verify", "--lr0", "--steps", "2"],
    ["capture", "--steps", "3", "--warmup", "1"],
    ["profile", "--steps", "2"],
], ids=["verify", "capture", "profile"])
def test_gpu_command_prints_no_warning(args):
    done = _moegraph(*args, *SHORT, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr  # UserWarning, FutureWarning, ...
