"""The planner's loss head (plan/loss_head.py): with run.loss_chunk auto it runs the head in
row chunks only where that makes the plan faster, charges the chunked head's memory by hand,
writes the choice into the plan file, and capture --plan's model takes it."""

import dataclasses
import json

import pytest

from cli_util import run_cli
from moegraph_cli.config import load_profile
from moegraph_cli.errors import UsageError
from moegraph_cli.plan import loss_head
from moegraph_cli.plan.memory import step_model
from moegraph_cli.plan.planfile import load_plan
from moegraph_cli.plan.scope_memory import tail_memory
from moegraph_cli.train.runspec import build_model, resolve

RECIPE = ["-p", "qwen3-30b-a3b", "--budget", "80GiB", "--nproc", "8", "--ep", "8",
          "--set", "run.batch=4", "--set", "run.seq_len=4096"]


def _plan(*args):
    code, out, err = run_cli("plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def _recomputed(r):
    return sum(1 for layer in r["layers"] for mode in layer["recompute"].values()
               if mode == "full")


def test_recipe_point_chunks_the_head_and_recomputes_less():
    auto = _plan(*RECIPE)
    whole = _plan(*RECIPE, "--set", "run.loss_chunk=0")
    assert auto["loss_chunk"] == loss_head.AUTO_ROWS and whole["loss_chunk"] == 0
    assert "in chunks of 2048 rows" in auto["loss_why"]
    assert auto["recompute_ms"] + auto["loss_chunk_ms"] < whole["recompute_ms"]
    assert _recomputed(auto) < _recomputed(whole)
    assert auto["required_budget"] <= 80 * 2**30


def test_no_chunks_where_the_whole_head_fits_as_well():
    r = _plan("--budget", "8GiB")  # tiny: 1024 tokens, below AUTO_ROWS
    assert r["loss_chunk"] == 0 and r["loss_chunk_ms"] == 0
    r = _plan(*RECIPE[:-2], "--set", "run.seq_len=256")  # 1024 tokens a rank
    assert r["loss_chunk"] == 0


def test_forced_rows_are_the_plans():
    r = _plan(*RECIPE, "--set", "run.loss_chunk=4096")
    assert r["loss_chunk"] == 4096 and "run.loss_chunk=4096" in r["loss_why"]


def test_chunked_tail_by_hand():
    prof = load_profile("qwen3-30b-a3b", ["run.batch=4", "run.seq_len=4096"])
    T, H, V, b = 16384, 2048, 151936, 2
    whole = tail_memory(prof)
    assert whole["logits"] == whole["biggest"] == b * T * V and whole["chunk_rows"] == 0
    t = tail_memory(prof, chunk_rows=2048)
    assert t["logits"] == b * T * H + b * V * H
    assert t["loss_fwd_transient"] == b * 2048 * V + 8 * T + 8 * 2048
    assert t["head_bwd_transient"] == 0 and t["biggest"] == b * V * H
    assert tail_memory(prof, chunk_rows=10**6)["chunk_rows"] == T  # one chunk of every row
    model = step_model(prof)
    eager = model.predict((False,) * len(model.scopes), "shared").eager_peak
    chunked = loss_head.with_head(model, 2048)
    assert chunked.predict((False,) * len(model.scopes), "shared").eager_peak < eager
    assert loss_head.chunk_ms(model, 2048) == pytest.approx(
        2 * b * (V + T) * H / 1e12 * 1e3 + 7 * 4 * 5e-3)


def test_plan_file_carries_the_head_to_the_model(tmp_path):
    path = tmp_path / "plan.yaml"
    code, _, err = run_cli("plan", "--budget", "8GiB", "--set", "run.loss_chunk=256",
                           "--out", str(path))
    assert code == 0, err
    spec = resolve("tiny-qwen3-moe")
    plan = load_plan(path, spec.profile)
    assert plan.loss_chunk() == 256
    assert build_model(spec, "cpu", plan=plan).loss_chunk == 256
    assert build_model(spec, "cpu").loss_chunk == 0  # auto without a plan
    text = path.read_text().replace("loss_chunk: 256", "loss_chunk: -3")
    path.write_text(text)
    with pytest.raises(UsageError, match="field 'loss_chunk' must be 0"):
        load_plan(path, spec.profile)


def test_each_head_is_predicted_with_its_own_tail():
    """The 12-layer slice at 4 x 4096 under 80 GiB: with the chunked head every scope is
    captured and nothing recomputed (the experts keep FC1's activation where room is left).
    (The eager phase's memo once ignored the tail, so the chunked head reused the whole
    head's eager peak and took recompute it did not need.)"""
    r = _plan("-p", "qwen3-30b-a3b-12layer", "--budget", "80GiB", "--set", "run.batch=4",
              "--set", "run.seq_len=4096")
    assert r["loss_chunk"] == loss_head.AUTO_ROWS
    assert all(set(layer["recompute"].values()) <= {"keep"} for layer in r["layers"])
    assert r["recompute_ms"] == 0
    spec = resolve("qwen3-30b-a3b-12layer", overrides=["run.batch=4", "run.seq_len=4096"])
    fresh = loss_head.with_head(step_model(spec.profile), loss_head.AUTO_ROWS)
    captured = tuple(True for _ in fresh.scopes)
    modes = tuple(r["layers"][ref.layer]["recompute"].get(ref.kind, "none")
                  for ref in fresh.scopes)
    fresh = dataclasses.replace(fresh, recompute=modes)
    assert r["required_budget"] == fresh.predict(captured, r["pool"]).required
