"""benchmarks/kernel_sweep.py end to end on the CPU (interpreter, fp32, a small shape), so
the script keeps up with the kernels' signatures: every record of the product's default and
of the grouped_mm and presorted comparisons is written, deterministic and equal where it must
be (the grouped_mm dW to fp32 rounding, the presorted paths bitwise), and every kernel's
`twin` (the default again, the run's resolution)."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_kernel_sweep_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import kernel_sweep as ks
    import moegraph_kernels.gemm_launch as gl
    import moegraph_kernels.wgrad as wg
    # The script switches the kernels' fallback off and sets the dW loop per candidate: put
    # both back after the test, whatever it does.
    monkeypatch.setattr(gl, "FALLBACK_ON_ERROR", gl.FALLBACK_ON_ERROR)
    monkeypatch.setattr(wg, "PADDED_K", wg.PADDED_K)
    monkeypatch.setattr(ks, "DEVICE", "cpu")
    for name, v in (("E", 6), ("H", 32), ("F", 16), ("K", 2)):
        monkeypatch.setattr(ks, name, v)
    out = tmp_path / "ks.json"
    monkeypatch.setattr(sys, "argv", ["kernel_sweep.py", "--tokens", "24", "--routing", "skewed",
                                      "--kernels", "dx,dact,wgrad_down,wgrad_gate_up",
                                      "--candidates",
                                      "grouped_mm,presorted,persistent+tmastore",
                                      "--out", str(out)])
    ks.main()
    recs = [r for r in json.loads(out.read_text())["records"] if "kernel" in r
            and r["kernel"] != "dense_mm"]
    assert {(r["kernel"], r["candidate"]) for r in recs} == {
        ("dx", "default"), ("dact", "default"), ("dact", "presorted"),
        *((k, "twin") for k in ("dx", "dact", "wgrad_down", "wgrad_gate_up")),
        ("wgrad_down", "default"), ("wgrad_down", "grouped_mm"), ("wgrad_down", "presorted"),
        ("wgrad_down", "persistent+tmastore"), ("wgrad_gate_up", "default"),
        ("wgrad_gate_up", "grouped_mm"), ("wgrad_gate_up", "presorted"),
        ("wgrad_gate_up", "persistent+tmastore")}
    for r in recs:
        assert "error" not in r, r
        assert r["deterministic"], r
        assert "ms" in r and "tflops" in r, r  # every record timed, not only a kernel's last
        assert ("twin_ratio" in r) == (r["candidate"] == "default"), r
        # torch's CPU grouped GEMM sums fp32 products in its own order (which depends on the
        # CPU's vector width): equal to the kernel's within rounding, not bitwise.
        # The presorted, persistent and TMA-store paths sum the same values in the same
        # order: bitwise.
        assert r["equal_default"] if r["candidate"] != "grouped_mm" else \
            r["max_abs_diff"] < 1e-6, r


def test_candidates_are_unique_and_twin_second(monkeypatch):
    """Each candidate name and config once per kernel, the default then its twin first: a
    duplicate would share one graph under one name and drop a record's timing."""
    monkeypatch.syspath_prepend(str(BENCH))
    import kernel_sweep as ks
    import torch
    from moegraph_cli.moe.experts import tile_configs
    for block_routes in (1024 * 8, 8192 * 8):
        cfg = tile_configs(block_routes, 128, 2048, 768, torch.device("cpu"))
        for kernel in ("fc1", "fc2", "dact", "dx", "wgrad_down", "wgrad_gate_up"):
            out = ks.all_candidates(kernel, 128, cfg)
            names = [n for n, _, _ in out]
            assert names[:2] == ["default", "twin"] and out[0][1] == out[1][1], kernel
            assert len(set(names)) == len(names), (kernel, names)
            plain = [c for n, c, _ in out[2:] if not n.startswith(("presorted", "grouped",
                                                                   "masked"))]
            assert out[0][1] not in plain and len(set(plain)) == len(plain), kernel


def test_round_orders_shuffle_neighbours(monkeypatch):
    """The interleaved timer's rounds: each a permutation, the first as given, seeded, and
    not a rotation (under which every fn keeps its predecessor in every round)."""
    monkeypatch.syspath_prepend(str(BENCH))
    from common import round_orders
    names = [f"c{i}" for i in range(12)]
    orders = round_orders(names, 6)
    assert orders[0] == names and all(sorted(o) == sorted(names) for o in orders)
    assert orders == round_orders(names, 6)  # seeded
    before = {n: {o[o.index(n) - 1] for o in orders} for n in names}
    assert sum(len(p) > 1 for p in before.values()) >= 10
    assert round_orders(["a"], 3) == [["a"]] * 3
