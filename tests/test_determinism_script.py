"""benchmarks/determinism.py's counting on the CPU: a part whose outputs repeat reports no
differing run, one whose outputs change reports each run that differed and by how much."""

from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def det(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import determinism
    return determinism


def test_repeat_counts_the_runs_that_differ(det):
    runs = iter(range(10))

    def part():
        i = next(runs)
        return {"same": torch.ones(4), "moves": torch.tensor([0.0, 1.0 if i % 3 else 0.0]),
                "last_bit": torch.tensor([1.0]) + (i == 4) * 2.0 ** -23}
    got = det.repeat(part, 5)
    assert got["same"] == {"runs_differing": 0, "max_abs_diff": 0.0}
    assert got["moves"] == {"runs_differing": 3, "max_abs_diff": 1.0}
    assert got["last_bit"]["runs_differing"] == 1
    assert got["last_bit"]["max_abs_diff"] == pytest.approx(2.0 ** -23)


def test_first_run_is_copied_not_aliased(det):
    buf = torch.zeros(3)

    def part():
        buf.add_(1.0)  # a part that reuses its output buffer, as .grad does
        return {"buf": buf}
    assert det.repeat(part, 3)["buf"]["runs_differing"] == 2
