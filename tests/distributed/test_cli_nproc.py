"""`moegraph ... --nproc N` end to end on CPU ranks (gloo): the launcher, the parallelism
checks, verify against one process, and a rank's error reaching the user as one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_util import run_cli

REPO = Path(__file__).resolve().parents[2]
CPU = ["--set", "run.device=cpu", "--set", "run.dtype=float32", "--set", "run.seq_len=32"]


def _moegraph(*args, timeout=300):
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MOEGRAPH_ERROR_DIR")}
    return subprocess.run([sys.executable, "-m", "moegraph_cli.app", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("nproc,ep", [(2, 2), (4, 4), (8, 8)])
def test_verify_against_single_process_fp32(nproc, ep):
    """Three steps at lr > 0: the distributed mean loss equals one process's within 1e-5.
    (8, 8) is the shape of the published recipe point (issue 13), on gloo."""
    r = _moegraph("verify", "--nproc", str(nproc), "--ep", str(ep), "--reference", "single",
                  "--no-lr0", "--steps", "3", "--tolerance", "1e-5", "--json", *CPU)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)  # one document, from rank 0 only
    assert doc["world_size"] == nproc and doc["ep"] == ep and doc["passed"]
    ref = doc["reference"]
    assert ref["kind"] == "single" and len(ref["single_losses"]) == 3
    assert ref["max_rel"] <= 1e-5
    assert [row["rank"] for row in doc["ranks"]] == list(range(nproc))
    assert all(row["passed"] and row["counters"]["fallback"] == 0 for row in doc["ranks"])
    # the graphed run tracks the eager one bitwise on every rank (same kernels, same order)
    assert all(row["bitwise_equal"] for row in doc["ranks"])


@pytest.mark.parametrize("profile,extra", [
    ("tiny-mixtral", ["--set", "model.sliding_window=16"]),
    ("tiny-olmoe", ["--set", "model.clip_qkv=0.5"]),
    ("tiny-qwen2-moe", ["--set", "model.mlp_only_layers=[0]", "--set",
                        "model.num_hidden_layers=3"]),
    ("tiny-deepseek-v3", []),
    ("tiny-gpt-oss", []),
])
def test_verify_each_family_against_single_process(profile, extra):
    """FSDP2 over the family's dense parameters (biases, q/k norms over the projection, a
    shared expert, MLA, sinks) and EP over its experts (with their biases, GPT-OSS; the
    grouped router's correction bias, DeepSeek-V3): the same losses as one process."""
    r = _moegraph("verify", "-p", profile, "--nproc", "2", "--ep", "2", "--reference",
                  "single", "--no-lr0", "--steps", "2", "--tolerance", "1e-5", "--json",
                  *CPU, *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["passed"] and doc["reference"]["max_rel"] <= 1e-5
    assert all(row["bitwise_equal"] for row in doc["ranks"])


@pytest.mark.parametrize("args,message", [
    (["--nproc", "2", "--ep", "3"], "--ep 3 does not divide the world size 2"),
    (["--nproc", "4", "--ep", "4", "--set", "model.num_experts=6"],
     "--ep 4 does not divide the model's 6 experts"),
    (["--ep", "2"], "--ep 2 needs several processes"),
    (["--nproc", "0"], "--nproc must be at least 1"),
])
def test_bad_parallelism_is_a_usage_error(args, message):
    code, out, err = run_cli("verify", *args, *CPU)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_rank_error_is_one_line_and_its_exit_code():
    r = _moegraph("verify", "--nproc", "2", "--set", "run.data=/nonexistent/tokens.pt", *CPU)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("moegraph: error: rank ")
    assert "run.data: token file /nonexistent/tokens.pt does not exist" in lines[0]


def test_started_by_torchrun():
    """The same command under torch's own launcher (RANK, WORLD_SIZE, LOCAL_RANK set)."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "moegraph_cli.app", "verify", "--ep", "2",
                        "--steps", "2", "--json", *CPU], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["world_size"] == 2 and doc["passed"] and len(doc["ranks"]) == 2
