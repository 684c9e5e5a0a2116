"""Graph engine on the GPU: capture + replay per scope set and profile, fallback counting,
OOM rollback, verify --lr0 bitwise in dropless and capacity modes."""

import pytest
import torch

from moegraph_cli.commands.capture import capture_command
from moegraph_cli.graphs import GraphSession
from moegraph_cli.train.harness import GraphTrainer, capture_into, peaks, reset_peaks, scope_specs
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.runspec import resolve
from moegraph_cli.train.trainer import batches
from moegraph_cli.commands.verify import verify_command

pytestmark = pytest.mark.cuda

FOUR_SMALL = ["run.seq_len=512"]


@pytest.mark.parametrize("profile,extra", [("tiny-qwen3-moe", []),
                                           ("qwen3-30b-a3b-4layer", FOUR_SMALL)])
@pytest.mark.parametrize("scopes", ["attn", "moe", "attn,moe"])
def test_capture_every_layer_and_replay_matches_eager(profile, extra, scopes):
    spec = resolve(profile, None, extra + [f"run.scopes={scopes}"])
    r = verify_command(spec, lr0=True, steps=3, progress=False)
    n_layers = spec.profile.model.num_hidden_layers
    assert r["counters"]["captured"] == n_layers * len(scopes.split(","))
    assert r["counters"]["fallback"] == 0
    assert r["counters"]["replayed"] == 3 * r["counters"]["captured"]
    assert r["bitwise_equal"], (r["eager_losses"], r["graph_losses"])
    assert r["passed"]


@pytest.mark.parametrize("mode", [["moe.mode=dropless"], ["moe.mode=capacity"]])
def test_verify_lr0_six_steps_bitwise(mode):
    r = verify_command(resolve("tiny-qwen3-moe", None, mode), lr0=True, steps=6, progress=False)
    assert r["bitwise_equal"] and r["passed"], r["verdict"]
    assert len(r["eager_losses"]) == 6 and all(l == l for l in r["eager_losses"])


def test_steady_state_capture_has_no_fallback_and_is_faster():
    r = capture_command(resolve("tiny-qwen3-moe", None, []), steps=10, warmup=2, progress=False)
    assert r["captured_ok"] and r["failure"] is None
    assert r["counters"]["fallback"] == 0 and r["counters"]["replayed"] > 0
    assert r["graph"]["step_ms"] < r["eager"]["step_ms"]
    assert r["pools"] and all(p["bytes"] > 0 for p in r["pools"])


def _tiny(device="cuda"):
    return MoeCausalLM.from_profile("tiny-qwen3-moe", device=device)


@pytest.mark.parametrize("strategy", ["per_entry", "shared"])
def test_seq_len_change_falls_back_and_is_counted(strategy):
    model = _tiny()
    tr = GraphTrainer(model, lr=0.0)
    session = GraphSession(scope_specs(model, ["attn", "moe"]), strategy=strategy)
    assert capture_into(model, session, next(batches(32000, 2, 512, 0, "cuda")))
    tr.session = session
    tr.step(next(batches(32000, 2, 512, 0, "cuda")))
    tr.step(next(batches(32000, 2, 256, 1, "cuda")))  # shorter sequence: contract breaks
    rows = session.stats()["scopes"]
    assert all(r["fallback"] == 1 for r in rows)
    if strategy == "per_entry":
        assert all("input 0 shape" in r["fallback_reason"] for r in rows)
    else:
        assert "input 0 shape" in rows[0]["fallback_reason"]
        assert all("pool group shared is eager" in r["fallback_reason"] for r in rows[1:])
    tr.step(next(batches(32000, 2, 512, 2, "cuda")))  # back to the captured shape
    assert all(r["replayed"] == 2 for r in session.stats()["scopes"])
    session.uninstall()


def _capped_after_eager_steps():
    """The tiny model after three eager steps, under a cap 8 MiB above the last one's peak
    (which no capture fits): (model, trainer, batches, allocated bytes before that step)."""
    model = _tiny()
    tr = GraphTrainer(model, lr=1e-4)
    it = batches(32000, 2, 512, 0, "cuda")
    for _ in range(2):
        tr.step(next(it))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    reset_peaks()
    tr.step(next(it))
    need = peaks()["peak_reserved"]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((need + 8 * 2**20) / total)
    return model, tr, it, before


def test_forced_oom_rolls_back_and_training_continues():
    model, tr, it, _ = _capped_after_eager_steps()
    try:
        session = GraphSession(scope_specs(model, ["attn", "moe"]), strategy="per_entry")
        ok = capture_into(model, session, next(it))
        assert not ok, "capture fit under the cap; the test's cap is too loose"
        assert "OutOfMemoryError" in session.failure and "layer" in session.failure
        assert not session.installed and all(s.fwd_graph is None for s in session.scopes)
        torch.cuda.empty_cache()
        losses = [float(tr.step(next(it))) for _ in range(3)]  # eager, same process
        assert all(l == l for l in losses)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_rolled_back_capture_holds_no_memory_afterwards():
    """After a capture that ran out of memory, the allocator is where it was before it: the
    recorded inputs, half-captured static buffers and every private pool are released."""
    model, tr, it, before = _capped_after_eager_steps()
    try:
        session = GraphSession(scope_specs(model, ["attn", "moe"]), strategy="per_entry")
        assert not capture_into(model, session, next(it)), "the cap is too loose"
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        private = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert after - before <= 2**20, f"{(after - before) / 2**20:.1f} MiB still held"
    assert not private, f"{len(private)} private-pool segments left"
