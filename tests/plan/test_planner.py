"""The planner: never over budget, monotone in the budget, nothing captured when only that fits;
one-line errors for budgets that cannot work; the plan file round trip; the CLI on a CPU."""

from __future__ import annotations

import json

import pytest

from moegraph_cli.units import fmt_bytes
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from cli_util import run_cli

from moegraph_cli.config import load_profile
from moegraph_cli.errors import MoegraphError, UsageError
from moegraph_cli.plan.memory import step_model
from moegraph_cli.plan.runkey import run_key
from moegraph_cli.plan.simulation import STRATEGIES
from moegraph_cli.plan.planfile import load_plan
from moegraph_cli.plan.planner import Savings, choose, estimated_savings, plan_command
from moegraph_cli.train.runspec import resolve

MiB = 2**20


def small_profile(layers: int, seq_len: int = 128, dense: tuple = ()):
    return load_profile("tiny-qwen3-moe", [f"model.num_hidden_layers={layers}",
                                           f"run.seq_len={seq_len}",
                                           f"model.mlp_only_layers={list(dense)}"])


def _same(a, b) -> bool:
    """Two choices alike in everything the plan reads from them."""
    if a is None or b is None:
        return a is b
    return (a.prediction, a.saved_ms, a.n_attn, a.n_ffn, a.modes, a.recompute_ms) == \
        (b.prediction, b.saved_ms, b.n_attn, b.n_ffn, b.modes, b.recompute_ms)


# -- properties ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 5), scopes=st.sampled_from([["attn"], ["moe"], ["attn", "moe"]]),
       pools=st.sampled_from([["shared"], ["per_scope"], ["per_entry"], list(STRATEGIES)]),
       frac=st.floats(0.0, 1.0), extra=st.floats(0.0, 0.5), dense=st.booleans())
def test_never_over_budget_and_monotone(layers, scopes, pools, frac, extra, dense):
    prof = small_profile(layers, dense=(0,) if dense and layers > 1 else ())
    model = step_model(prof)
    n = len(model.scopes)
    lo = model.predict((False,) * n, "shared").required
    hi = max(model.predict((True,) * n, s).required for s in STRATEGIES)
    budget = int(lo + frac * (hi - lo))
    gains = estimated_savings()
    best = choose(model, budget, scopes, pools, gains)
    assert best is not None  # capturing nothing always fits at >= the eager peak
    assert best.prediction.peak <= best.prediction.required <= budget
    assert all(ref.kind == "attn" or "moe" in scopes
               for ref, c in zip(model.scopes, best.prediction.captured) if c)
    assert all(ref.kind != "attn" or "attn" in scopes
               for ref, c in zip(model.scopes, best.prediction.captured) if c)
    # plan_command's later per-strategy searches reuse the fits of this one: same answers
    fits: dict = {}
    assert _same(choose(model, budget, scopes, pools, gains, fits=fits), best)
    for s in pools:
        assert _same(choose(model, budget, scopes, [s], gains, fits=fits),
                     choose(model, budget, scopes, [s], gains))
    more = choose(model, int(budget * (1 + extra)) + 1, scopes, pools, gains)
    assert more.saved_ms >= best.saved_ms - 1e-9
    assert more.prediction.peak <= int(budget * (1 + extra)) + 1
    # enough budget for everything captures everything requested
    full = choose(model, hi, scopes, pools, gains)
    assert full.saved_ms == pytest.approx(sum(
        gains.of(r) for r in model.scopes
        if ("attn" in scopes if r.kind == "attn" else "moe" in scopes)))


@settings(max_examples=20, deadline=None)
@given(layers=st.integers(1, 6), below=st.floats(0.0, 0.999))
def test_nothing_captured_when_only_that_fits(layers, below):
    model = step_model(small_profile(layers))
    n = len(model.scopes)
    eager = model.predict((False,) * n, "shared").required
    cheapest_capture = min(model.predict(tuple(i == j for j in range(n)), s).required
                           for i in range(n) for s in STRATEGIES)
    assert cheapest_capture > eager
    budget = int(eager + below * (cheapest_capture - eager))
    best = choose(model, budget, ["attn", "moe"], list(STRATEGIES), estimated_savings(),
                  recompute="none")
    assert not any(best.prediction.captured)
    assert best.saved_ms == 0
    # With recompute (run.recompute auto) a capture may fit there: only by recomputing.
    auto = choose(model, budget, ["attn", "moe"], list(STRATEGIES), estimated_savings())
    assert auto.prediction.required <= budget
    if any(auto.prediction.captured):
        assert any(m != "none" for m in auto.modes) and auto.recompute_ms > 0
    # Below the eager step nothing fits without recompute; with it (run.recompute auto) a
    # plan, where one fits, recomputes and stays under the budget.
    assert choose(model, eager - 1, ["attn", "moe"], list(STRATEGIES), estimated_savings(),
                  recompute="none") is None
    rec = choose(model, eager - 1, ["attn", "moe"], list(STRATEGIES), estimated_savings())
    if rec is not None:
        assert rec.prediction.required <= eager - 1
        assert any(m != "none" for m in rec.modes) and rec.recompute_ms > 0


def test_shared_pool_preferred_when_everything_fits():
    model = step_model(small_profile(4))
    n = len(model.scopes)
    per_entry = model.predict((True,) * n, "per_entry").required
    shared = model.predict((True,) * n, "shared").required
    assert shared < per_entry
    best = choose(model, per_entry - 1, ["attn", "moe"], list(STRATEGIES), estimated_savings())
    assert all(best.prediction.captured) and best.prediction.strategy == "shared"
    # per_entry forced under the same budget cannot capture everything
    forced = choose(model, per_entry - 1, ["attn", "moe"], ["per_entry"], estimated_savings())
    assert not all(forced.prediction.captured)
    assert forced.saved_ms < best.saved_ms


def test_measured_savings_steer_the_choice():
    model = step_model(small_profile(3))
    n = len(model.scopes)
    budget = model.predict((True,) * n, "shared").required
    gains = Savings({}, {"attn": 0.8, "moe": -0.1}, "test")  # replaying moe is slower
    best = choose(model, budget, ["attn", "moe"], ["shared"], gains)
    assert [r.kind for r, c in zip(model.scopes, best.prediction.captured) if c] == ["attn"] * 3
    assert best.saved_ms == pytest.approx(2.4)


# -- errors -------------------------------------------------------------------------------
def test_budget_below_static_states_the_minimum():
    spec = resolve("tiny-qwen3-moe", overrides=["run.recompute=none"])
    with pytest.raises(MoegraphError) as e:
        plan_command(spec, budget="100MiB")
    assert e.value.exit_code == 1  # a valid request that cannot be met, not a usage error
    msg = str(e.value)
    assert "\n" not in msg
    assert "below the static memory" in msg and "310.21 MiB" in msg  # weights+grads+AdamW
    eager = step_model(spec.profile).predict((False,) * 4, "shared").required
    assert f"smallest budget that fits a step is {fmt_bytes(eager)}" in msg


def test_budget_that_fits_nothing_states_the_smallest():
    spec = resolve("tiny-qwen3-moe", overrides=["run.recompute=none"])
    eager = step_model(spec.profile).predict((False,) * 4, "shared").required
    with pytest.raises(MoegraphError) as e:
        plan_command(spec, budget=str(eager - MiB))
    assert e.value.exit_code == 1
    msg = str(e.value)
    assert "\n" not in msg and "even with nothing captured" in msg
    assert f"smallest budget that fits is {fmt_bytes(eager)}" in msg
    assert plan_command(spec, budget=str(eager))["predicted_peak"] <= eager


# -- plan file ----------------------------------------------------------------------------
def test_plan_yaml_round_trip(tmp_path):
    spec = resolve("tiny-qwen3-moe", overrides=["model.num_hidden_layers=3",
                                                "model.mlp_only_layers=[2]"])
    path = tmp_path / "plan.yaml"
    r = plan_command(spec, budget="4GiB", pool="per_entry", out=str(path))
    plan = load_plan(path, spec.profile)
    assert plan.layer_scopes() == {0: ["attn", "moe"], 1: ["attn", "moe"], 2: ["attn", "moe"]}
    groups = plan.scope_groups()
    assert groups == {f"layers.{i}.{k}": None for i, k in
                      [(0, "attn"), (0, "moe"), (1, "attn"), (1, "moe"), (2, "attn"),
                       (2, "mlp")]}
    pools = plan.predicted_pool_bytes()
    assert set(pools) == {f"{n}.{g}" for n in groups for g in ("fwd", "bwd")}
    assert pools == r["pools"] and plan.predicted_peak == r["predicted_peak"]
    raw = yaml.safe_load(path.read_text())
    assert raw["key"]["batch"] == 2 and raw["key"]["seq_len"] == 512
    assert raw["key"]["dtype"] == "bfloat16" and raw["key"]["moe_mode"] == "dropless"
    assert raw["key"]["model_hash"] == run_key(spec.profile)["model_hash"]
    assert sum(layer["predicted_bytes"] for layer in raw["layers"]) == \
        r["pool_bytes"] + r["io_bytes"]


@pytest.mark.parametrize("pool,groups", [("auto", {"shared"}), ("shared", {"shared"}),
                                         ("per_scope", {"attn", "moe"})])
def test_plan_with_pooled_groups(tmp_path, pool, groups):
    spec = resolve("tiny-qwen3-moe")
    path = tmp_path / "plan.yaml"
    plan_command(spec, budget="1.5GiB", pool=pool, out=str(path))
    plan = load_plan(path, spec.profile)
    assert set(plan.scope_groups().values()) == groups
    assert set(plan.predicted_pool_bytes()) == groups  # GraphSession.pools() names them so
    assert {n.split(".")[-1] for n, g in plan.scope_groups().items()} == {"attn", "moe"}


def test_left_out_says_what_did_not_fit():
    spec = resolve("tiny-qwen3-moe", overrides=["run.recompute=none"])
    model = step_model(spec.profile)
    all_in = model.predict((True,) * 4, "shared").required
    r = plan_command(spec, budget=str(all_in - 1), pool="shared")
    assert [layer["scopes"] for layer in r["layers"]] == [["attn", "moe"], ["attn"]]
    blocked = model.predict((True,) * 4, "shared").required
    assert r["left_out"] == [f"moe on layer 1: capturing layers.1.moe too needs "
                             f"{fmt_bytes(blocked)} (predicted peak plus allocation headroom), "
                             f"over the budget {fmt_bytes(all_in - 1)}"]


def test_plan_refused_for_another_run(tmp_path):
    path = tmp_path / "plan.yaml"
    plan_command(resolve("tiny-qwen3-moe"), budget="1.5GiB", out=str(path))
    other = load_profile("qwen3-30b-a3b-4layer")
    with pytest.raises(UsageError, match="was made for tiny-qwen3-moe .* not this run "
                                         "qwen3-30b-a3b-4layer"):
        load_plan(path, other)
    longer = load_profile("tiny-qwen3-moe", ["run.seq_len=1024"])
    with pytest.raises(UsageError, match="seq_len 512.*not this run.*seq_len 1024"):
        load_plan(path, longer)


@pytest.mark.parametrize("text,match", [
    (None, "no such file"), ("a: [1, 2", "not valid YAML"),
    ("just a string", "not a moegraph plan"),
    ("moegraph_plan: 1\nkey: {}\n", "field 'pool' is missing")])
def test_plan_file_errors(tmp_path, text, match):
    path = tmp_path / "plan.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=match) as e:
        load_plan(path, load_profile("tiny-qwen3-moe"))
    assert "\n" not in str(e.value)


# -- CLI ----------------------------------------------------------------------------------
def test_cli_plan_json():
    code, stdout, stderr = run_cli("plan", "--profile", "tiny-qwen3-moe", "--budget", "1.5GiB",
                                   "--json")
    assert code == 0, stderr
    r = json.loads(stdout)
    for key in ("profile", "source", "budget", "layers", "static_bytes", "eager_peak",
                "pool_bytes", "predicted_peak", "saved_ms", "left_out", "out", "pools"):
        assert key in r
    assert r["profile"] == "tiny-qwen3-moe" and r["budget"] == 3 * 2**29
    assert r["predicted_peak"] <= r["budget"] and r["pool"] == "shared"
    assert [layer["scopes"] for layer in r["layers"]] == [["attn", "moe"], ["attn", "moe"]]


def test_cli_plan_scopes_restrict():
    code, stdout, stderr = run_cli("plan", "--budget", "1.5GiB", "--scopes", "attn", "--json")
    assert code == 0, stderr
    r = json.loads(stdout)
    assert [layer["scopes"] for layer in r["layers"]] == [["attn"], ["attn"]]
    assert r["left_out"] == ["moe on layers 0-1: not requested (scopes: attn)"]


def test_cli_plan_budget_auto_on_cpu_is_a_usage_error():
    code, _, stderr = run_cli("plan", "--budget", "auto")
    assert code == 2
    err = stderr.strip()
    assert len(err.splitlines()) == 1 and "--budget auto" in err and "no CUDA device" in err


def test_cli_plan_writes_file(tmp_path):
    out = tmp_path / "p.yaml"
    code, stdout, stderr = run_cli("plan", "--budget", "1200MiB", "--out", str(out))
    assert code == 0, stderr
    assert f"wrote {out}" in stdout
    assert load_plan(out, load_profile("tiny-qwen3-moe")).predicted_peak <= 1200 * MiB


def test_plan_step_prices_the_whole_step_and_refuses_what_does_not_fit():
    from moegraph_cli.errors import NotCapturableError
    from moegraph_cli.plan.planner import plan_command
    from moegraph_cli.train.runspec import resolve

    spec = resolve("qwen3-30b-a3b-4layer", None, ["run.scopes=[step]"])
    result = plan_command(spec, budget="130GiB")
    assert result["pool"] == "step" and result["pools"]["step"] == result["pool_bytes"]
    assert result["predicted_peak"] >= result["static_bytes"] + result["pool_bytes"]
    with pytest.raises(NotCapturableError, match="whole step needs"):
        plan_command(spec, budget=f"{result['static_bytes'] + 2**20}")
    with pytest.raises(NotCapturableError, match="several processes"):
        plan_command(spec, budget="130GiB", nproc=2, ep=2)
