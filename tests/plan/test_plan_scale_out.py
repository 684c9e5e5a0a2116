"""Per-rank memory falls (or stays flat) as GPUs are added: the planner's model of bounded EP
dispatch and of experts sharded over their replicas, at the published operating points."""

import json

import pytest

from cli_util import run_cli
from torch_caps import needs_mesh
from moegraph_cli.config import load_profile
from moegraph_cli.plan.memory import step_model
from moegraph_cli.plan.parallel import Parallel

GiB = 2**30


def _plan(*args):
    code, out, err = run_cli("plan", *args, "--budget", "80GiB", "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("args", [
    ["-p", "qwen3-30b-a3b", "--nproc", "8", "--ep", "8", "--set", "run.batch=4",
     "--set", "run.seq_len=4096"],
    pytest.param(["-p", "deepseek-v3", "--nproc", "256", "--ep", "64"], marks=needs_mesh),
    pytest.param(["-p", "gpt-oss-120b", "--nproc", "32", "--ep", "8"], marks=needs_mesh),
], ids=["qwen3-recipe", "deepseek-256-64", "gpt-oss-120b-32-8"])
def test_published_points_fit_80gib(args):
    r = _plan(*args)
    assert r["required_budget"] <= 80 * GiB


def test_deepseek_per_rank_peak_does_not_grow_with_ep():
    prof = load_profile("deepseek-v3", ["run.recompute=none"])
    peaks = []
    for ep in (16, 64, 256):
        m = step_model(prof, parallel=Parallel(256, ep))
        peaks.append(m.predict((False,) * len(m.scopes), "shared").peak)
    assert peaks[2] <= peaks[1] <= peaks[0]


@needs_mesh
def test_qwen3_static_falls_with_data_parallel_ranks():
    prof = load_profile("qwen3-30b-a3b")
    s8 = step_model(prof, parallel=Parallel(8, 8)).static["total"]
    s64 = step_model(prof, parallel=Parallel(64, 8)).static["total"]
    assert s64 <= s8 / 4
