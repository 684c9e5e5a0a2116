"""The planner chooses recompute where the budget needs it, prices it, and writes it per layer;
a plan's recompute is validated on load and applied to the model it builds."""

import dataclasses
import json

import pytest
import yaml

from cli_util import run_cli
from moegraph_cli.errors import UsageError
from moegraph_cli.plan.memory import step_model
from moegraph_cli.plan.planfile import load_plan
from moegraph_cli.plan.recompute import ladder, modes_at
from moegraph_cli.plan.scope_memory import recomputed
from moegraph_cli.train.runspec import build_model, resolve

TWELVE = ["-p", "qwen3-30b-a3b-12layer", "--budget", "80GiB", "--set", "run.batch=4",
          "--set", "run.seq_len=4096"]


def _recomputes(layer) -> set[str]:
    """A plan layer's recompute modes, the kept activation (`keep`: less than none) aside."""
    return set(layer["recompute"].values()) - {"keep"}


def test_recipe_slice_fits_80gib_by_recompute_and_not_without():
    # with the logits whole (the chunked head fits without recompute: below)
    code, out, err = run_cli("plan", *TWELVE, "--set", "run.loss_chunk=0", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["required_budget"] <= 80 * 2**30
    assert any(_recomputes(layer) for layer in r["layers"])
    assert r["recompute_ms"] > 0 and "without it" in r["recompute_why"]
    code, _, err = run_cli("plan", *TWELVE, "--set", "run.recompute=none",
                           "--set", "run.loss_chunk=0")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "run.recompute=none" in err and "most of it static memory" in err
    # the loss head in chunks (plan/loss_head.py) holds no logits: then it fits without
    code, out, err = run_cli("plan", *TWELVE, "--set", "run.recompute=none", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["loss_chunk"] > 0 and not any(layer["recompute"] for layer in r["layers"])
    # forced none keeps no activation either


def test_no_recompute_where_the_budget_does_not_need_it(tmp_path):
    """With room to spare nothing is recomputed, and every MoE layer keeps FC1's activation
    (the permute-free experts the planner prices on a GPU); the plan file carries that to the
    model."""
    path = tmp_path / "plan.yaml"
    code, out, err = run_cli("plan", "--budget", "8GiB", "--json", "--out", str(path))
    assert code == 0, err
    r = json.loads(out)
    assert all(layer["recompute"] == {"moe": "keep"} for layer in r["layers"])
    assert r["recompute_ms"] == 0 and "keep FC1's activation on layers" in r["recompute_why"]
    spec = resolve("tiny-qwen3-moe")
    model = build_model(spec, "cpu", plan=load_plan(path, spec.profile))
    assert all(layer.ffn.recompute == "keep" and layer.attn.recompute == "none"
               for layer in model.layers)


def test_plan_keeps_the_activation_only_where_the_budget_has_room(tmp_path):
    """Between the budget that keeps FC1's activation on every MoE layer and the one that
    keeps it on none, the plan keeps it on some: the ladder's first rungs take `keep` back
    one layer at a time, before any recompute, at no modelled cost."""
    spec = resolve("qwen3-30b-a3b-12layer", overrides=["run.batch=4", "run.seq_len=4096"])
    model = step_model(spec.profile)
    base, steps = ladder(model, "auto")
    moe = [i for i, r in enumerate(model.scopes) if r.kind == "moe"]
    assert [base[i] for i in moe] == ["keep"] * len(moe)
    assert [(s.scope, s.mode, s.ms) for s in steps[:len(moe)]] == [(i, "none", 0.0) for i in moe]
    args = ["-p", "qwen3-30b-a3b-12layer", "--set", "run.batch=4", "--set", "run.seq_len=4096",
            "--set", "run.loss_chunk=0", "--scopes", "", "--json"]

    def plan(*extra):
        code, out, err = run_cli("plan", *args, *extra)
        assert code == 0, err
        return json.loads(out)

    kept, bare = plan("--budget", "200GiB"), plan("--budget", "200GiB", "--set",
                                                  "run.recompute=none")
    assert all(layer["recompute"] == {"moe": "keep"} for layer in kept["layers"])
    gap = kept["required_budget"] - bare["required_budget"]
    assert gap >= 12 * model.kinds["moe"].keep_saved // 2, gap
    path = tmp_path / "plan.yaml"
    r = plan("--budget", str(bare["required_budget"] + gap // 2), "--out", str(path))
    modes = [layer["recompute"] for layer in r["layers"]]
    assert {"moe": "keep"} in modes and {} in modes, modes
    assert all(m in ({}, {"moe": "keep"}) for m in modes), modes
    assert r["recompute_ms"] == 0
    plan_file = load_plan(path, spec.profile)
    assert plan_file.layer_recompute() == dict(enumerate(modes))


def test_forced_recompute_on_every_layer():
    code, out, err = run_cli("plan", "--budget", "8GiB", "--set", "run.recompute=attn+fc1",
                             "--json")
    assert code == 0, err
    layers = json.loads(out)["layers"]
    assert all(layer["recompute"] == {"attn": "full", "moe": "fc1"} for layer in layers)


def test_memory_falls_along_the_ladder():
    spec = resolve("qwen3-30b-a3b-12layer", overrides=["run.batch=4", "run.seq_len=4096"])
    model = step_model(spec.profile)
    base, steps = ladder(model, "auto")
    none = (False,) * len(model.scopes)
    peaks = [dataclasses.replace(model, recompute=modes_at(base, steps, n))
             .predict(none, "shared").peak for n in range(0, len(steps) + 1, 6)]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    moe = model.kinds["moe"]
    assert recomputed(moe, "full").saved == 0 and recomputed(moe, "full").saves_input
    assert recomputed(moe, "fc1").saved == moe.saved - moe.fc1_saved > 0
    kept = recomputed(moe, "keep")
    assert kept.saved == moe.saved + moe.keep_saved and kept.keep_saved == 0
    assert 2 * moe.keep_saved == moe.fc1_saved  # A [S, F] beside Y1 [S, 2F]


def test_plan_recompute_applied_and_validated(tmp_path):
    path = tmp_path / "plan.yaml"
    code, _, err = run_cli("plan", "--budget", "8GiB", "--set", "run.recompute=full",
                           "--out", str(path))
    assert code == 0, err
    spec = resolve("tiny-qwen3-moe")
    plan = load_plan(path, spec.profile)
    model = build_model(spec, "cpu", plan=plan)
    assert all(layer.attn.recompute == "full" and layer.ffn.recompute == "full"
               for layer in model.layers)
    doc = yaml.safe_load(path.read_text())
    doc["layers"][0]["recompute"] = {"attn": "fc1"}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(UsageError, match="layer 0 recompute 'attn': 'fc1' is not one of"):
        load_plan(path, spec.profile)


def test_bad_recompute_value_is_a_usage_error():
    code, _, err = run_cli("plan", "--budget", "8GiB", "--set", "run.recompute=most")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "run.recompute 'most' must be one of auto, none, attn, moe, full, fc1" in err
