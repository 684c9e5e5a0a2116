"""Two GPUs, NCCL: the moe graph holds the EP all-gather and all_to_all; FSDP2 all-gathers and
reduce-scatters stay outside the graphs. verify at lr 0 must be bitwise on every rank with no
fallback, and capture must install on both ranks. Skipped with fewer than two GPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

REPO = Path(__file__).resolve().parents[2]


def _moegraph(*args):
    env = dict(os.environ, MOEGRAPH_COLLECTIVE_TIMEOUT_S="180")
    r = subprocess.run([sys.executable, "-m", "moegraph_cli.app", *args, "--json"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_verify_lr0_bitwise_on_every_rank(mode):
    doc = _moegraph("verify", "--nproc", "2", "--ep", "2", "--steps", "3",
                    "--set", f"moe.mode={mode}", "--set", "run.seq_len=256")
    assert doc["passed"] and doc["world_size"] == 2
    for row in doc["ranks"]:
        assert row["bitwise_equal"] and row["grad_max_abs"] == 0
        assert row["counters"]["fallback"] == 0 and row["counters"]["replayed"] > 0


def test_capture_installs_on_both_ranks():
    doc = _moegraph("capture", "--nproc", "2", "--ep", "2", "--steps", "3", "--warmup", "1",
                    "--set", "run.seq_len=256")
    assert doc["captured_ok"] and doc["failure"] is None
    for row in doc["ranks"]:
        assert row["counters"]["fallback"] == 0 and row["counters"]["captured"] == 4
