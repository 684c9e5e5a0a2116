"""`moegraph profile` pieces that run without a GPU: the CLI's exit code, the NVML sampler
(degrading, and always shutting down), the plot, and the savings / calibration files the
planner reads."""

from __future__ import annotations

import json
import sys
import types

import pytest
import yaml
from cli_util import run_cli

from moegraph_cli.errors import MoegraphError, UsageError
from moegraph_cli.report.nvml import NvmlSampler
from moegraph_cli.plan.calibration import load_calibration, lookup, write_entry
from moegraph_cli.plan.runkey import run_key
from moegraph_cli.plan.planner import load_savings, plan_command
from moegraph_cli.commands.profile import write_savings
from moegraph_cli.train.runspec import resolve

MiB = 2**20


def test_cli_profile_on_cpu_exits_4_with_one_line():
    code, _, stderr = run_cli("profile", "--profile", "tiny-qwen3-moe")
    assert code == 4
    assert stderr.strip().splitlines() == [
        "moegraph: error: no CUDA device: this command needs an NVIDIA GPU"]


# -- NVML sampler ---------------------------------------------------------------------------
class FakeNvml(types.ModuleType):
    def __init__(self, fail_init=False):
        super().__init__("pynvml")
        self.fail_init, self.inits, self.shutdowns, self.reads = fail_init, 0, 0, 0

    def nvmlInit(self):
        self.inits += 1
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.reads += 1
        return types.SimpleNamespace(used=(1 + self.reads) * MiB, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=50, memory=10)


def test_nvml_sampler_samples_and_shuts_down_on_error(monkeypatch):
    import time
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(KeyError):
        with NvmlSampler(0, interval_s=0.005) as nv:
            nv.mark("eager")
            time.sleep(0.08)
            nv.mark("graph")
            time.sleep(0.04)
            raise KeyError("body failed")
    assert fake.inits == 1 and fake.shutdowns == 1
    assert nv._thread is None  # joined
    assert len(nv.samples) >= 5
    used = [s[1] for s in nv.samples]
    assert used == sorted(used) and used[0] == 2 * MiB  # each read a new value, in order
    summary = nv.summary()
    assert summary["note"] is None and set(summary["phases"]) == {"eager", "graph"}
    assert summary["max_used_bytes"] == used[-1] and summary["mean_util_pct"] == 50
    n = len(nv.samples)
    time.sleep(0.03)
    assert len(nv.samples) == n  # stopped


def test_nvml_sampler_degrades_without_nvml(monkeypatch):
    fake = FakeNvml(fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with NvmlSampler(0) as nv:
        nv.mark("eager")
    assert nv.samples == [] and nv.timeline()["used_bytes"] == []
    assert "NVML unavailable (RuntimeError: NVML Shared Library Not Found)" in nv.note
    assert nv.summary()["samples"] == 0


# -- plot -------------------------------------------------------------------------------
def test_plot_without_matplotlib_is_one_clear_line(monkeypatch):
    import importlib.util

    from moegraph_cli.report import plot
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(MoegraphError) as e:
        plot.require_matplotlib()
    assert str(e.value) == \
        "--plot needs matplotlib, which is not installed (pip install matplotlib)"


def _fake_result():
    return {
        "profile": "tiny-qwen3-moe", "pool": "shared",
        "scopes": [{"name": f"layers.{i}.{k}", "kind": k, "layer": i, "eager_ms": 1.5 + i,
                    "replay_ms": 0.5, "saved_ms": 1.0 + i, "kernels": 120}
                   for i in range(2) for k in ("attn", "moe")],
        "pools": [{"name": "shared", "bytes": 3 * 2**30}],
        "eager_peak_reserved": 20 * 2**30, "graph_peak_reserved": 21 * 2**30,
        "eager_step_ms": 10.0, "graph_step_ms": 7.0, "key": run_key(resolve().profile),
        "gpu": "test", "torch": "x", "date": "today",
    }


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from moegraph_cli.report.plot import profile_plot
    timeline = {"t_s": [i * 0.05 for i in range(100)],
                "used_bytes": [(18 + (i > 50) * 3) * 2**30 for i in range(100)],
                "util_pct": [90] * 100,
                "marks": [{"t_s": 0.0, "phase": "eager"}, {"t_s": 2.0, "phase": "capture"},
                          {"t_s": 2.5, "phase": "graph"}, {"t_s": 4.5, "phase": "per-scope"}]}
    path = tmp_path / "p.png"
    profile_plot(str(path), _fake_result(), timeline)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


# -- savings and calibration files ----------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_savings_file_round_trip_and_plan_uses_it(tmp_path, suffix):
    path = tmp_path / f"savings{suffix}"
    result = _fake_result()
    write_savings(str(path), result)
    doc = json.loads(path.read_text()) if suffix == ".json" else yaml.safe_load(path.read_text())
    assert doc["per_kind"]["attn"]["saved_ms"] == pytest.approx(1.5)  # mean of 1.0, 2.0
    s = load_savings(path, result["key"])
    assert s.per_name == {"layers.0.attn": 1.0, "layers.0.moe": 1.0, "layers.1.attn": 2.0,
                          "layers.1.moe": 2.0}
    r = plan_command(resolve(), budget="1.5GiB", savings=str(path))
    assert r["saved_ms"] == pytest.approx(6.0) and r["savings_source"].startswith("measured")
    other = run_key(resolve(overrides=["run.seq_len=256"]).profile)
    with pytest.raises(UsageError, match="measured for .*seq_len 512.*not this run.*seq_len 256"):
        load_savings(path, other)


def _entry(key, saved):
    return {"key": key, "gpu": "test", "scopes": {"attn": {
        "saved_bytes": saved, "out_bytes": MiB, "in_grad_bytes": MiB,
        "fwd_peak_bytes": 3 * saved, "bwd_peak_bytes": 2 * saved, "saves_input": False,
        "private_pools": [4 * saved, 2 * saved]}}}


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_calibration_file_entries_by_run(tmp_path, suffix):
    path = tmp_path / f"cal{suffix}"
    key = run_key(resolve().profile)
    other = run_key(resolve(overrides=["run.batch=4"]).profile)
    write_entry(path, _entry(key, 4 * MiB))
    write_entry(path, _entry(other, 8 * MiB))
    write_entry(path, _entry(key, 6 * MiB))  # replaces the first
    entries = load_calibration(path)
    assert [e["scopes"]["attn"]["saved_bytes"] for e in entries] == [8 * MiB, 6 * MiB]
    entry, note = lookup(path, key)
    assert entry["scopes"]["attn"]["saved_bytes"] == 6 * MiB and note == f"calibration {path}"
    r = plan_command(resolve(), budget="1.5GiB", calibration=str(path), pool="per_entry")
    assert r["memory_model"] == f"calibration {path}"
    assert r["pools"]["layers.0.attn.fwd"] == 24 * MiB
    assert r["scope_memory"]["attn"]["saved"] == 6 * MiB
    missing, note = lookup(path, run_key(resolve(overrides=["run.seq_len=64"]).profile))
    assert missing is None and note.startswith("analytical (") and "no entry" in note


def test_calibration_file_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_calibration(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("moegraph_calibration: 1\nentries:\n- key: {}\n  scopes: {attn: {}}\n")
    with pytest.raises(UsageError, match="entry 0 scope attn lacks integer saved_bytes"):
        load_calibration(bad)
