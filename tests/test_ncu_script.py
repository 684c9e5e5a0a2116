"""benchmarks/ncu_kernels.py's reading of ncu's raw page, on the CPU: each profiled launch is
keyed by the launch order, units and thousands separators handled, stalls ranked, and a
launch count that does not match the order is an error rather than a shifted table."""

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

RAW = '''"ID","Kernel Name","gpu__time_duration.sum","gpc__cycles_elapsed.avg.per_second","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_not_issued_per_issue_active.ratio","launch__grid_size"
"","","nsecond","hz","ratio","ratio","ratio",""
"0","_dact_swiglu_kernel","630,000","1,740,000,000","0.50","2.25","9.0","3,840"
"1","nvjet_sm90_tst","400,000","1,455,000,000","0.10","0.05","1.0","132"
'''


@pytest.fixture()
def ncu(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import ncu_kernels
    return ncu_kernels


def test_summarize_keys_launches_by_order(ncu):
    order = [{"T": 8192, "routing": "uniform", "kernel": "dact"},
             {"T": 8192, "routing": "uniform", "kernel": "dense_mm"}]
    recs = ncu.summarize(RAW, order)
    assert [r["kernel"] for r in recs] == ["dact", "dense_mm"]
    assert recs[0]["kernel_name"] == "_dact_swiglu_kernel"
    assert recs[0]["duration_us"] == pytest.approx(630.0)
    assert recs[0]["sm_mhz"] == pytest.approx(1740.0)
    assert recs[0]["grid"] == 3840
    assert list(recs[0]["stalls"]) == ["long_scoreboard", "barrier"]  # ranked, not_issued out
    assert recs[1]["stalls"]["barrier"] == pytest.approx(0.10)


def test_launch_count_mismatch_is_an_error(ncu):
    with pytest.raises(ValueError, match="profiled 2 launches"):
        ncu.summarize(RAW, [{"T": 1, "routing": "u", "kernel": "dact"}])


PAGE = '''"Kernel Name","_expert_wgrad_kernel",""
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"
"0x1","      LDC R1, c[0x0][0x28]","10","1,056","0","10","0"
"0x2","      BAR.SYNC.DEFER_BLOCKING 0x0","60","837,120","50","10","50"
"0x3","      HGMMA.64x128x16.F32.BF16 R24","20","837,120","0","0","0"
"0x4","      STSM.16.M88.4 [R8], R136","10","98,304","0","0","0"
"0x5","      NOP","0","0","0","0","0"
'''


def test_source_summary_groups_samples_by_executions(ncu):
    got = ncu.source_summary(PAGE, top=2)
    assert got["samples"] == 100
    groups = {g["executed"]: (g["instructions"], g["share"]) for g in got["by_executions"]}
    assert groups[837120] == (2, pytest.approx(0.8))  # the K loop
    assert groups[98304] == (1, pytest.approx(0.1))   # once a tile
    assert 0 not in groups                            # never ran, no samples
    assert [t["sass"] for t in got["top"]] == ["BAR.SYNC.DEFER_BLOCKING 0x0",
                                               "HGMMA.64x128x16.F32.BF16 R24"]
    assert got["top"][0]["reasons"] == {"barrier": pytest.approx(0.5),
                                        "long_sb": pytest.approx(0.1)}
