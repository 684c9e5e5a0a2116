"""benchmarks/common.py's interleaved timer on a GPU: every fn runs its warm-up and then
`reps` calls a round, the rounds' order shuffled (round_orders), each burst optionally led by
an untimed one; experts.py's timing of one small case gives
the four timings with the SM clock each ran at."""

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_interleaved_rounds_follow_round_orders_and_count(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from common import interleaved_ms, round_orders
    log = []
    x = torch.ones(256, device="cuda")

    def body(name):
        def run():
            log.append(name)
            x.mul_(1.0)
        return run
    out = interleaved_ms({n: body(n) for n in "abc"}, reps=2, rounds=4, warmup=1,
                         lead=body("L"))
    assert set(out) == set("abc") and all(v["ms"] > 0 for v in out.values())
    assert log[:3] == list("abc")  # the warm-ups
    bursts = [log[3 + 4 * i: 3 + 4 * (i + 1)] for i in range(12)]
    assert all(b[:2] == ["L", "L"] and b[2] == b[3] for b in bursts)  # led, back to back
    assert [b[2] for b in bursts] == [n for order in round_orders(list("abc"), 4)
                                      for n in order]
    assert len(log) == 3 + 12 * 4


def test_experts_time_case_interleaved(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import experts
    fn = experts.impls()["permute_free"]
    case, dout = experts.make_case((8, 128, 64, 2), 64, "skewed", 0.25)
    out = experts.time_case(fn, case, dout, reps=2, rounds=2, graphs=True)
    keys = ("fwd_ms", "fwd_bwd_ms", "graph_fwd_ms", "graph_fwd_bwd_ms")
    assert all(out[k] > 0 for k in keys), out
    assert set(out["sm_mhz"]) == set(keys) and out["peak_bytes"] > 0


def test_kernel_sweep_interleaved_on_the_gpu(tmp_path, monkeypatch):
    """kernel_sweep.py at a small shape on the GPU: every candidate of the kernels asked for
    is timed in the interleaved rounds, with the clock it ran at."""
    import json
    import sys
    monkeypatch.syspath_prepend(str(BENCH))
    import kernel_sweep as ks
    import moegraph_kernels.gemm_launch as gl
    import moegraph_kernels.wgrad as wg
    monkeypatch.setattr(gl, "FALLBACK_ON_ERROR", gl.FALLBACK_ON_ERROR)
    monkeypatch.setattr(wg, "PADDED_K", wg.PADDED_K)
    for name, v in (("E", 8), ("H", 256), ("F", 128), ("K", 2)):
        monkeypatch.setattr(ks, name, v)
    out = tmp_path / "ks.json"
    monkeypatch.setattr(sys, "argv", ["kernel_sweep.py", "--tokens", "256", "--routing",
                                      "skewed", "--kernels", "dact,wgrad_down", "--candidates",
                                      "persistent,tmastore", "--rounds", "2", "--out", str(out)])
    ks.main()
    recs = [r for r in json.loads(out.read_text())["records"] if r["kernel"] != "dense_mm"]
    assert {(r["kernel"], r["candidate"]) for r in recs} == {
        ("dact", "default"), ("dact", "twin"), ("wgrad_down", "default"),
        ("wgrad_down", "twin"), ("wgrad_down", "persistent"), ("wgrad_down", "tmastore")}
    for r in recs:
        assert "error" not in r and r["ms"] > 0 and r["equal_default"], r
        assert "sm_mhz" in r
    assert all(r["twin_ratio"] > 0 for r in recs if r["candidate"] == "default")


def test_tiles_ab_entries_equal_and_timed(monkeypatch):
    """tiles_ab.py at T = 512: the default, its twin, two alts and `all` each captured,
    bitwise equal to the default (the variants' promise), and timed."""
    import argparse
    monkeypatch.syspath_prepend(str(BENCH))
    import tiles_ab
    import moegraph_kernels.gemm_launch as gl
    monkeypatch.setattr(gl, "FALLBACK_ON_ERROR", False)
    alts = [tiles_ab.parse_alt("dxp:dx=+tma+persistent"),
            tiles_ab.parse_alt("dact5:dact=64x128x64x8x4x5")]
    args = argparse.Namespace(skew=0.25, rounds=2, forward=False)
    recs = tiles_ab.run_case(512, "skewed", alts, args)
    assert [r["entry"] for r in recs] == ["default", "twin", "dxp", "dact5", "all"]
    for r in recs:
        assert "error" not in r and r["equal_default"] and r["ms"] > 0, r
    assert recs[0]["ratio_to_default"] == 1.0
    # --forward: the forward alone, its output compared; a third of fwd+bwd's FLOPs
    fwd = tiles_ab.run_case(512, "skewed", alts[:1], argparse.Namespace(
        skew=0.25, rounds=2, forward=True))
    assert [r["entry"] for r in fwd] == ["default", "twin", "dxp"]
    for r in fwd:
        assert "error" not in r and r["equal_default"] and r["ms"] > 0, r
    assert fwd[0]["ms"] < recs[0]["ms"]
    assert fwd[0]["tflops"] == pytest.approx(recs[0]["tflops"] * recs[0]["ms"] / fwd[0]["ms"]
                                             / 3)


def test_elementwise_ab_group_equal_and_timed(monkeypatch):
    """elementwise_ab.py's route-count group: every entry captured and timed, each but the
    copy floor compared with the default (bitwise, and its largest difference)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import elementwise_ab
    recs = elementwise_ab.run_group("counts", 4096, 2)
    assert [r["entry"] for r in recs] == ["default", "twin", "scatter_add", "copy"]
    for r in recs:
        assert "error" not in r and r["ms"] > 0 and r["gb_per_s"] > 0, r
    assert all(r["equal_default"] and r["max_abs_diff"] == 0 for r in recs[:3])
    assert "equal_default" not in recs[3]
    assert recs[0]["ratio_to_default"] == 1.0
