"""`moegraph ... --nproc N` end to end on CPU ranks (gloo): the launcher, the parallelism
checks, verify against one process, and a rank's error reaching the user as one line.

Each family's `moegraph verify --ep 2 --reference single` runs in two gloo ranks started by
the tests (gloo_util), the CLI in-process in each, as torchrun would start it: the launcher
is the same for every family and its own tests are the ones above and below."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_util import run_cli
from gloo_util import run_gloo

REPO = Path(__file__).resolve().parents[2]
CPU = ["--set", "run.device=cpu", "--set", "run.dtype=float32", "--set", "run.seq_len=32"]
# CPU-small widths: what is checked (sharding, dispatch, agreement with one process) does not
# depend on them, and at the profiles' own (vocabulary 32000, hidden 512) eight ranks on a
# small machine take minutes.
SMALL = [a for o in ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
                     "model.num_key_value_heads=2", "model.head_dim=8",
                     "model.moe_intermediate_size=16", "model.intermediate_size=48"]
         for a in ("--set", o)]
# DeepSeek-V3's MLA widths at that size (as tests/models/test_deepseek_v3.py)
MLA = [a for o in ["model.num_key_value_heads=4", "model.head_dim=4", "model.qk_rope_head_dim=4",
                   "model.qk_nope_head_dim=8", "model.v_head_dim=6", "model.q_lora_rank=12",
                   "model.kv_lora_rank=10"]
       for a in ("--set", o)]


def _moegraph(*args, timeout=300):
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MOEGRAPH_ERROR_DIR")}
    return subprocess.run([sys.executable, "-m", "moegraph_cli.app", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("nproc,ep", [(8, 8)])
def test_verify_against_single_process_fp32(nproc, ep):
    """Three steps at lr > 0: the distributed mean loss equals one process's within 1e-5.
    (8, 8) is the shape of the published recipe point (issue 13), on gloo. Fewer ranks run
    the same path: two with ep 2 against one process in every family
    (test_verify_each_family_against_single_process, the CLI in each gloo rank), two through
    the launcher (test_started_by_torchrun, test_launch.py), four through the launcher
    (test_expert_shards.py, ep 2, and test_multinode.py), and ep 4 of 4 in-process
    (test_expert_shards.py, test_ep_overflow.py, moe/test_ep_dispatch.py)."""
    r = _moegraph("verify", "--nproc", str(nproc), "--ep", str(ep), "--reference", "single",
                  "--no-lr0", "--steps", "3", "--tolerance", "1e-5", "--json", *CPU, *SMALL)
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
                        "model.num_hidden_layers=3", "--set",
                        "model.shared_expert_intermediate_size=20"]),
    ("tiny-deepseek-v3", MLA),
    ("tiny-gpt-oss", []),
])
def test_verify_each_family_against_single_process(profile, extra, tmp_path, monkeypatch):
    """FSDP2 over the family's dense parameters (biases, q/k norms over the projection, a
    shared expert, MLA, sinks) and EP over its experts (with their biases, GPT-OSS; the
    grouped router's correction bias, DeepSeek-V3): the same losses as one process."""
    argv = ["verify", "-p", profile, "--ep", "2", "--reference", "single", "--no-lr0",
            "--steps", "2", "--tolerance", "1e-5", "--json", *CPU, *SMALL, *extra]
    monkeypatch.setenv("MOEGRAPH_COLLECTIVE_TIMEOUT_S", "120")  # a hung rank ends the test
    run_gloo(_cli_in_rank, 2, argv, tmp_path)
    (code0, out0, err0), (code1, out1, err1) = [
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert code0 == code1 == 0, (err0[-2000:], err1[-2000:])
    assert out1 == ""  # rank 0 alone renders
    doc = json.loads(out0)
    assert doc["world_size"] == 2 and doc["ep"] == 2
    assert doc["passed"] and doc["reference"]["max_rel"] <= 1e-5
    assert all(row["bitwise_equal"] for row in doc["ranks"])


def _cli_in_rank(rank, world, argv, out_dir):
    """`moegraph *argv` in this rank (the CLI in-process; the job's env is set): its exit
    code, stdout and stderr to out_dir/rank{rank}.json."""
    code, out, err = run_cli(*argv)
    (out_dir / f"rank{rank}.json").write_text(json.dumps([code, out, err]))


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
                        "--steps", "2", "--json", *CPU, *SMALL], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["world_size"] == 2 and doc["passed"] and len(doc["ranks"]) == 2
