"""Planner and profile on a GPU: a calibrated plan predicts the measured peak of a shared-pool
capture; `moegraph profile` writes its savings file and plot.

Peaks are measured in a fresh subprocess (profile.steady_peaks) so nothing this test process
cached or leaked earlier counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_util import run_cli

from moegraph_cli.plan.planner import load_savings, plan_command
from moegraph_cli.train.runspec import resolve

pytestmark = pytest.mark.cuda
REPO = Path(__file__).resolve().parents[2]


def _in_subprocess(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_calibrated_plan_predicts_shared_capture_peak(tmp_path):
    cal, plan = tmp_path / "cal.yaml", tmp_path / "plan.yaml"
    _in_subprocess(
        "import json, torch\n"
        "from moegraph_cli.train.runspec import resolve\n"
        "from moegraph_cli.commands.profile import calibrate_run\n"
        "from moegraph_cli.plan.calibration import write_entry\n"
        f"write_entry({str(cal)!r}, calibrate_run(resolve('tiny-qwen3-moe'), "
        "torch.device('cuda')))\n"
        "print(json.dumps({'ok': True}))\n")
    spec = resolve("tiny-qwen3-moe")
    r = plan_command(spec, budget="64GiB", pool="shared", out=str(plan),
                     calibration=str(cal))
    assert r["memory_model"] == f"calibration {cal}"
    assert all(layer["scopes"] == ["attn", "moe"] for layer in r["layers"])
    m = _in_subprocess(
        "import json\n"
        "from moegraph_cli.train.runspec import resolve\n"
        "from moegraph_cli.commands.profile import steady_peaks\n"
        f"print(json.dumps(steady_peaks(resolve('tiny-qwen3-moe'), {str(plan)!r})))\n")
    assert m["captured_ok"] and m["counters"]["fallback"] == 0
    measured = m["graph"]["peak_reserved"]
    predicted = r["predicted_peak"]
    assert abs(measured - predicted) <= 0.10 * measured, (predicted, measured)
    # every pool the session reports has a prediction under the same name
    assert m["pools"] and all(p["predicted_bytes"] is not None for p in m["pools"])


def test_per_entry_costs_more_than_shared_as_predicted(tmp_path):
    spec = resolve("tiny-qwen3-moe")
    peaks = {}
    for pool in ("shared", "per_entry"):
        plan = tmp_path / f"{pool}.yaml"
        r = plan_command(spec, budget="64GiB", pool=pool, out=str(plan))
        m = _in_subprocess(
            "import json\n"
            "from moegraph_cli.train.runspec import resolve\n"
            "from moegraph_cli.commands.profile import steady_peaks\n"
            f"print(json.dumps(steady_peaks(resolve('tiny-qwen3-moe'), {str(plan)!r})))\n")
        assert m["captured_ok"], m["failure"]
        measured_pools = sum(p["bytes"] for p in m["pools"])
        peaks[pool] = (r["pool_bytes"], measured_pools)
    assert peaks["per_entry"][0] > peaks["shared"][0]
    assert peaks["per_entry"][1] > peaks["shared"][1]


def test_profile_tiny_writes_savings_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    savings, png, cal = tmp_path / "savings.json", tmp_path / "p.png", tmp_path / "cal.yaml"
    code, stdout, stderr = run_cli("profile", "--profile", "tiny-qwen3-moe", "--steps", "3",
                                   "--out", savings, "--plot", png, "--calibrate", cal, "--json")
    assert code == 0, stderr[-3000:]
    r = json.loads(stdout)
    assert {s["name"] for s in r["scopes"]} == {"layers.0.attn", "layers.0.moe",
                                                 "layers.1.attn", "layers.1.moe"}
    assert all(s["replay_ms"] < s["eager_ms"] for s in r["scopes"])  # tiny is launch-bound
    assert r["kernels_graph"] < r["kernels_eager"]
    assert r["graph_step_ms"] < r["eager_step_ms"]
    s = load_savings(savings, r["key"])
    assert set(s.per_name) == {x["name"] for x in r["scopes"]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = plan_command(resolve("tiny-qwen3-moe"), budget="64GiB", savings=str(savings),
                        calibration=str(cal))
    assert plan["savings_source"].startswith("measured")
    assert plan["memory_model"] == f"calibration {cal}"
