"""benchmarks/common.py's interleaved timer on a GPU: every fn runs its warm-up and then
`reps` calls a round, the rounds' order rotated; experts.py's timing of one small case gives
the four timings with the SM clock each ran at."""

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_interleaved_rounds_rotate_and_count(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from common import interleaved_ms
    log = []
    x = torch.ones(256, device="cuda")

    def body(name):
        def run():
            log.append(name)
            x.mul_(1.0)
        return run
    out = interleaved_ms({n: body(n) for n in "abc"}, reps=2, rounds=4, warmup=1)
    assert set(out) == set("abc") and all(v["ms"] > 0 for v in out.values())
    assert log[:3] == list("abc")  # the warm-ups
    rounds = [log[3 + 6 * r: 3 + 6 * (r + 1)] for r in range(4)]
    assert [r[::2] for r in rounds] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert all(r[::2] == r[1::2] for r in rounds)  # reps back to back
    assert len(log) == 3 + 4 * 6


def test_experts_time_case_interleaved(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import experts
    fn = experts.impls()["permute_free"]
    case, dout = experts.make_case((8, 128, 64, 2), 64, "skewed", 0.25)
    out = experts.time_case(fn, case, dout, reps=2, rounds=2, graphs=True)
    keys = ("fwd_ms", "fwd_bwd_ms", "graph_fwd_ms", "graph_fwd_bwd_ms")
    assert all(out[k] > 0 for k in keys), out
    assert set(out["sm_mhz"]) == set(keys) and out["peak_bytes"] > 0
