"""A step whose bounded EP dispatch overflows is detected, agreed, redone and counted
(distributed/overflow.py), on CPU gloo ranks.

The skew is moe/routing.py's measurement router `skewed_route`, patched over
models/common/ffn.route in every process, the one-process reference included: a token whose
first feature after the post norm is above -1.5 (about 93% of them) gets +8 on the logits of
experts 0..k-1, so most tokens route to EP rank 0 (P = 2, 4) or ranks 0 and 1 (P = 8) only,
past the rows a pair holds at `moe.ep_capacity_factor=1.0`: every step overflows. The redone
steps must equal, bit for bit, a run through the all-gather (`moe.ep_dispatch=all_gather`),
graphed or not, and the losses and gradients one process over the same global batch.
"""

import pytest
import torch
import torch.distributed as dist

from gloo_util import run_gloo

SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=2", "run.device=cpu",
         "run.dtype=float32", "run.batch=2", "run.seq_len=16"]
BOUNDED = ["moe.ep_dispatch=all_to_all", "moe.ep_capacity_factor=1.0"]
GATHER = ["moe.ep_dispatch=all_gather"]


def _skew_router():
    from moegraph_cli.models.common import ffn
    from moegraph_cli.moe.routing import skewed_route
    ffn.route = skewed_route


def _spec(extra):
    from moegraph_cli.train.runspec import resolve
    return resolve("tiny-qwen3-moe", None, SMALL + list(extra))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _dropped(model):
    return [b.clone() for n, b in model.named_buffers() if n.endswith("dropped_routes")]


def _redo_is_exact(rank, world, ep, extra, steps=2, lr=1e-2):
    from moegraph_cli.distributed.runtime import setup
    from moegraph_cli.train.harness import make_trainer
    from moegraph_cli.train.runspec import build_model
    from moegraph_cli.train.trainer import Trainer, batches

    _skew_router()
    rt = setup(ep, 8, "cpu", 60)
    runs = {}
    for name, opts in (("bounded", BOUNDED), ("gather", GATHER)):
        torch.manual_seed(0)
        model = build_model(_spec(list(extra) + opts), rt.device, rt=rt)
        runs[name] = (model, make_trainer(model, lr, 0.0, rt),
                      batches(128, 2, 16, 1, "cpu", rank=rank, world=world))
    (mb, tb, ib), (mg, tg, ig) = runs["bounded"], runs["gather"]
    assert all(m.ep_bounded is None for m in tb.overflow.scopes) and tb.overflow.scopes
    losses, first_grads = [], None
    for step in range(steps):
        lb, lg = tb.step(next(ib)), tg.step(next(ig))
        assert lb.item() == lg.item(), step
        for (n, a), (_, b) in zip(mb.named_parameters(), mg.named_parameters()):
            assert torch.equal(_local(a.grad), _local(b.grad)), n
        if first_grads is None:
            first_grads = {n: _full(p.grad).clone() for n, p in mb.named_parameters()}
        total = lb.clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    assert all(m.ep_bounded for m in tb.overflow.scopes)
    assert tb.overflow.steps == steps and tb.overflow.rows > 0, tb.overflow.report()
    assert tg.overflow.steps == 0 and not tg.overflow.armed
    for a, b in zip(_dropped(mb), _dropped(mg)):  # counted once, whichever pass stood
        assert torch.equal(a, b)
    if "moe.mode=capacity" in extra:
        return  # capacity is decided per source rank: one process decides it differently
    # One process, same global batches: every rank checks its own shard of the gradients.
    torch.manual_seed(0)
    single = build_model(_spec(GATHER), torch.device("cpu"))
    trainer = Trainer(single, lr, 0.0)
    it = batches(128, 2 * world, 16, 1, "cpu")
    lo, hi = rt.expert_range
    for step in range(steps):
        loss = trainer.step(next(it)).item()
        assert abs(loss - losses[step]) <= 1e-5 * abs(loss), (step, loss, losses[step])
        if step:
            continue
        for n, p in single.named_parameters():
            want = p.grad[lo:hi] if first_grads[n].shape != p.grad.shape else p.grad
            torch.testing.assert_close(first_grads[n], want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("world,ep,extra", [
    (2, 2, []),
    (4, 4, ["moe.mode=capacity", "moe.capacity_factor=2.0"]),
    (4, 2, []),  # experts replicated over 2 data-parallel replicas
])
def test_overflowed_steps_are_redone_exactly(world, ep, extra):
    run_gloo(_redo_is_exact, world, ep, extra)


@pytest.mark.slow
def test_overflowed_steps_are_redone_exactly_8_ranks():
    run_gloo(_redo_is_exact, 8, 8, [])


def _graph_redo(rank, world, ep, extra, steps=3):
    from moegraph_cli.distributed.runtime import setup
    from moegraph_cli.train.harness import build_session, capture_into, make_trainer
    from moegraph_cli.train.runspec import build_model
    from moegraph_cli.train.trainer import batches

    _skew_router()
    spec = _spec(list(extra) + BOUNDED)
    rt = setup(ep, 8, "cpu", 60)
    eager = build_model(spec, rt.device, rt=rt)
    te = make_trainer(eager, 0.0, 0.0, rt)
    graphed = build_model(spec, rt.device, rt=rt)
    tg = make_trainer(graphed, 0.0, 0.0, rt)
    session = build_session(graphed, ["attn", "moe"], "shared", rt=rt)
    assert session.backend.name == "emulated"
    ids = next(batches(128, 2, 16, 0, "cpu", rank=rank, world=world))
    assert capture_into(graphed, session, ids, rt), session.failure
    tg.session = session
    ie = batches(128, 2, 16, 1, "cpu", rank=rank, world=world)
    ig = batches(128, 2, 16, 1, "cpu", rank=rank, world=world)
    for step in range(steps):
        assert te.step(next(ie)).item() == tg.step(next(ig)).item(), step
        for (n, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
            assert torch.equal(_local(a.grad), _local(b.grad)), n
    assert te.overflow.report() == tg.overflow.report()
    assert tg.overflow.steps == steps
    tot = session.stats()["totals"]
    # every step replayed (the overflow counted inside the moe graphs), then ran eagerly
    # with the graphs suspended: no fallback, nothing captured again
    assert tot["replayed"] == steps * 4 and tot["fallback"] == 0 and tot["captured"] == 4
    assert session.installed and all(s.module.forward is s for s in session.scopes)


@pytest.mark.parametrize("world,ep,extra", [
    (2, 2, []),
    (4, 2, ["moe.mode=capacity", "moe.capacity_factor=2.0"]),
])
def test_graphed_overflow_redo_matches_eager_bitwise(world, ep, extra):
    run_gloo(_graph_redo, world, ep, extra)


# -- the CLI ---------------------------------------------------------------------------------
def _moegraph(*args, timeout=400):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MOEGRAPH_ERROR_DIR")}
    return subprocess.run([sys.executable, "-m", "moegraph_cli.app", *args],
                          cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _skewed_checkpoint(directory):
    """`moegraph init` at the SMALL sizes in fp32, then skewed on disk: +1 on the first hidden
    feature of every embedding row (after the post norm it is about 5.6, the others about
    0.1), and in every router (`mlp.gate.weight`) +0.5 on that feature for EP rank 0's
    experts (0-3 of 8 at ep 2), -0.5 for the others: nearly every token routes to rank 0."""
    from safetensors.torch import load_file, save_file

    from cli_util import run_cli

    sets = [x for s in SMALL if s.startswith("model.") for x in ("--set", s)]
    code, _, err = run_cli("init", "tiny-qwen3-moe", str(directory), *sets, "--set",
                           "run.dtype=float32")
    assert code == 0, err[-2000:]
    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][:, 0] += 1.0
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            t[:4, 0] += 0.5
            t[4:, 0] -= 0.5
    save_file(tensors, path, metadata={"format": "pt"})


def test_verify_against_one_process_with_forced_overflow(tmp_path):
    """`verify --nproc 2 --ep 2 --reference single` on the skewed checkpoint at factor 1:
    auto takes the all-to-all (C = 26 rows a pair for 32 tokens a rank), every step overflows
    and is redone, and the run still equals one process and its graphs the eager run."""
    import json

    _skewed_checkpoint(tmp_path / "ckpt")
    r = _moegraph("verify", "--checkpoint", str(tmp_path / "ckpt"), "--nproc", "2", "--ep",
                  "2", "--reference", "single", "--no-lr0", "--steps", "3", "--tolerance",
                  "1e-5", "--json", "--set", "run.device=cpu", "--set", "run.dtype=float32",
                  "--set", "run.seq_len=16", "--set", "moe.ep_capacity_factor=1.0")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["passed"] and doc["reference"]["max_rel"] <= 1e-5, doc["verdict"]
    assert doc["ep_overflow_steps"] == 3 and doc["ep_overflow_rows"] > 0
    assert all(row["bitwise_equal"] and row["counters"]["fallback"] == 0
               for row in doc["ranks"])


@pytest.mark.parametrize("value,message", [
    ("0.5", "moe.ep_capacity_factor must be a finite number >= 1, got 0.5"),
    ("-1", "moe.ep_capacity_factor must be a finite number >= 1, got -1.0"),
    (".inf", "--set moe.ep_capacity_factor: expected a finite number, got inf"),
    (".nan", "--set moe.ep_capacity_factor: expected a finite number, got nan"),
])
def test_bad_ep_capacity_factor_is_a_usage_error(value, message):
    from cli_util import run_cli

    code, _, err = run_cli("verify", "--nproc", "2", "--ep", "2", "--set",
                           f"moe.ep_capacity_factor={value}", "--set", "run.device=cpu")
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_overflow_counts_are_rendered(capsys):
    from moegraph_cli.report.render import capture_result, profile_result, verify_result

    phase = {"step_ms": 1.0, "ep_overflow_steps": 2, "ep_overflow_rows": 9}
    capture_result({"profile": "p", "scopes": ["attn", "moe"], "pool": "shared", "ep": 2,
                    "eager": {**phase, "ep_overflow_steps": 1}, "graph": phase,
                    "counters": {"captured": 4, "replayed": 8, "fallback": 0,
                                 "input_copies": 0}}, False)
    text = capsys.readouterr().out
    def cells(label):
        return [[c.strip() for c in ln.split("\u2502")[1:-1]] for ln in text.splitlines()
                if label in ln]

    assert cells("EP overflow steps") == [["EP overflow steps (redone)", "1", "2"]]
    assert cells("EP rows over the bound") == [["EP rows over the bound", "9", "9"]]
    done = {"ep": 2, "ep_overflow_steps": 3, "ep_overflow_rows": 40}
    verify_result({"profile": "p", "lr": 0.0, "scopes": ["moe"], "eager_losses": [1.0],
                   "graph_losses": [1.0], "grad_max_abs": 0.0, "grad_worst": "-",
                   "passed": True, "verdict": "ok", **done}, False)
    profile_result({"profile": "p", "scopes": [], "eager_step_ms": 1.0, "graph_step_ms": 1.0,
                    **done}, False)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "EP dispatch overflow" in ln]
    assert lines == ["EP dispatch overflow: 3 steps redone through the all-gather, 40 rows "
                     "over the bound (all ranks)"] * 2
