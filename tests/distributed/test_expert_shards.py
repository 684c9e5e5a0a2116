"""Experts sharded over their replicas (dist/model.py): with N ranks and EP degree E each
expert lives on N / E ranks and FSDP2 shards its weights, gradients and AdamW states over them.

On CPU ranks (gloo), against one process over the same global batch: the loss of every step
and, gathered whole, every gradient and every updated weight; graphed (emulated backend)
against eager bitwise; a checkpoint fills the shards; per-rank expert bytes halve when the
replicas double; N == E keeps the experts plain.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gloo_util import run_gloo
from torch_caps import needs_mesh

from moegraph_cli.distributed.layout import experts_sharded

# On a torch without FSDP2's per-parameter mesh the tests against one process check the
# experts kept whole on every replica instead (experts_sharded).

REPO = Path(__file__).resolve().parents[2]

SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=2", "run.device=cpu",
         "run.dtype=float32", "run.batch=2", "run.seq_len=16"]
LR = 1e-2


def _setup(ep, extra=(), checkpoint=None, profile="tiny-qwen3-moe"):
    from moegraph_cli.distributed.runtime import setup
    from moegraph_cli.train.runspec import resolve

    if checkpoint is None:
        spec = resolve(profile, None, SMALL + list(extra))
    else:
        spec = resolve(None, checkpoint, [o for o in SMALL if o.startswith("run.")])
    return spec, setup(ep, spec.profile.model.num_experts, "cpu", 60)


def _whole(name, t, rt):
    """The full tensor of parameter (or gradient) `name`, on every rank: a DTensor gathered,
    an EP rank's expert stack concatenated over the EP group."""
    from moegraph_cli.models.common.init import is_expert_stack

    t = t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
    if is_expert_stack(name) and rt.ep is not None:
        parts = [torch.empty_like(t) for _ in range(rt.ep.size)]
        dist.all_gather(parts, t.contiguous(), group=rt.ep.group)
        t = torch.cat(parts)
    return t


def _against_one_process(rank, world, ep, steps, profile="tiny-qwen3-moe", extra=(), dim=0):
    from moegraph_cli.distributed.model import expert_parameters, is_sharded
    from moegraph_cli.models.common.init import shard_dim
    from moegraph_cli.train.harness import make_trainer
    from moegraph_cli.train.runspec import build_model
    from moegraph_cli.train.trainer import Trainer, batches

    spec, rt = _setup(ep, extra, profile=profile)
    model = build_model(spec, rt.device, rt=rt)
    experts = expert_parameters(model)
    sharded = experts_sharded(world, ep)
    assert experts and all(is_sharded(p) for p in experts) == sharded
    # whole experts (0) or their rows (1)
    assert {shard_dim(p) for p in experts} == {dim if sharded else 0}
    trainer = make_trainer(model, LR, 0.1, rt)
    single = build_model(spec, torch.device("cpu"))
    reference = Trainer(single, LR, 0.1)
    mine = batches(128, 2, 16, 5, "cpu", rank=rank, world=world)
    glob = batches(128, 2 * world, 16, 5, "cpu")
    tol = dict(rtol=1e-5, atol=1e-6)
    for step in range(steps):
        loss = trainer.step(next(mine)).reshape(1)
        dist.all_reduce(loss)
        want = reference.step(next(glob))
        torch.testing.assert_close(loss[0] / world, want, **tol)
        ref_params = dict(single.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(_whole(name, p.grad, rt), ref_params[name].grad,
                                       **tol, msg=lambda m, n=name, s=step: f"{n} grad, step "
                                                                            f"{s}: {m}")
            # AdamW's first steps move every weight by about lr: a hundredth of that tells a
            # shard stepped once, with the right moments, from one left out or stepped twice
            torch.testing.assert_close(_whole(name, p, rt), ref_params[name].detach(),
                                       rtol=0, atol=LR * 1e-2,
                                       msg=lambda m, n=name, s=step: f"{n}, step {s}: {m}")


@pytest.mark.parametrize("world,ep", [(4, 2), (2, 1), (4, 4)])
def test_gradients_and_updates_equal_one_process(world, ep):
    """Two AdamW steps: losses, gathered gradients and updated weights (experts included,
    sharded over 2 replicas at 4 / 2, over every rank at ep 1; plain at 4 / 4)."""
    run_gloo(_against_one_process, world, ep, 2)


def test_tied_head_equals_one_process():
    """A tied head: the embedding, read at both ends of the step, stays in the root unit."""
    run_gloo(_against_one_process, 2, 1, 2, "tiny-qwen3-moe", ["model.tie_word_embeddings=true"])


@pytest.mark.parametrize("world,ep,experts", [
    (4, 2, 2), (4, 1, 2), (2, 1, 1),
    pytest.param(8, 4, 4, marks=pytest.mark.slow),
])
def test_row_sharded_experts_equal_one_process(world, ep, experts):
    """Fewer local experts than replicas: 1 a rank over 2 replicas (4 / 2 and 8 / 4, the dp
    mesh's placement), 2 over 4 or 1 over 2 (ep 1, the layer's mesh), so the stacks shard on
    dim 1 (distributed/layout.expert_shard_dim). Seeded whole, they must still be the
    one-process model, and train like it."""
    extra = [f"model.num_experts={experts}", f"model.num_experts_per_tok={min(2, experts)}"]
    run_gloo(_against_one_process, world, ep, 1 if world == 8 else 2, "tiny-qwen3-moe", extra,
             1)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_gradients_equal_one_process_8_ranks(ep):
    """8 ranks: experts over 4 replicas (ep 2) or 2 (ep 4); one step."""
    run_gloo(_against_one_process, 8, ep, 1)


@pytest.mark.parametrize("experts", [8, 2])
def test_expert_biases_equal_one_process(experts):
    """GPT-OSS: expert biases, sharded like the stacks (with 2 experts, on dim 1: the biases'
    columns as the stacks' rows); 4 ranks, ep 2. (Capacity mode decides drops per rank over
    its own tokens, so it matches no one-process run of the global batch: graph against eager
    covers it, test_dist_graphs.py.)"""
    run_gloo(_against_one_process, 4, 2, 1, "tiny-gpt-oss",
             ["model.layer_types=[sliding_attention,full_attention]"]
             + (["model.num_experts=2"] if experts == 2 else []), 1 if experts == 2 else 0)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _expert_bytes(rank, world, ep, out):
    from moegraph_cli.distributed.model import expert_parameters, is_sharded
    from moegraph_cli.train.harness import make_trainer
    from moegraph_cli.train.runspec import build_model
    from moegraph_cli.train.trainer import batches

    spec, rt = _setup(ep)
    model = build_model(spec, rt.device, rt=rt)
    trainer = make_trainer(model, LR, 0.0, rt)
    trainer.step(next(batches(128, 2, 16, 0, "cpu", rank=rank, world=world)))
    opt = trainer.optimizer
    alias = {id(p): a for p, a in zip(opt.sharded, opt.local)}
    figures = {"weights": 0, "grads": 0, "adam": 0, "sharded": []}
    for p in expert_parameters(model):
        figures["weights"] += _local(p).nbytes
        figures["grads"] += _local(p.grad).nbytes
        state = opt.optimizer.state[alias.get(id(p), p)]
        figures["adam"] += state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes
        figures["sharded"].append(is_sharded(p))
    everyone = rt.gather_all(figures)
    if rank == 0:
        out.write_text(json.dumps(everyone))


@needs_mesh
def test_expert_bytes_per_rank_halve_when_replicas_double(tmp_path):
    """World 2 / ep 2 (experts plain) against world 4 / ep 2 (each expert on 2 ranks): every
    rank's expert weights, gradients and AdamW states take half the bytes."""
    figures = {}
    for world in (2, 4):
        out = tmp_path / f"world{world}.json"
        run_gloo(_expert_bytes, world, 2, out)
        figures[world] = json.loads(out.read_text())
    two, four = figures[2], figures[4]
    assert all(not any(r["sharded"]) for r in two) and all(all(r["sharded"]) for r in four)
    # 2 layers x 4 local experts x (w_gate_up [32, 32] + w_down [32, 16]) fp32 at world 2
    assert two[0]["weights"] == 2 * 4 * (32 * 32 + 32 * 16) * 4
    for key in ("weights", "grads", "adam"):
        assert {r[key] for r in two} == {two[0][key]}
        assert {r[key] for r in four} == {two[0][key] // 2}, key
    assert two[0]["adam"] == 2 * two[0]["weights"]


def _without_mesh(rank, world, ep, fn, *args):
    """`fn` on a rank whose torch is taken to have no per-parameter mesh (as torch 2.11)."""
    from moegraph_cli.distributed import layout

    layout.per_parameter_mesh = lambda: False
    fn(rank, world, ep, *args)


def test_experts_whole_on_each_replica_without_a_per_parameter_mesh(tmp_path):
    """4 ranks, ep 2, on a torch taken to have no per-parameter mesh: each rank keeps its
    experts whole (plain tensors, gradients all-reduced over the 2 replicas), trains like one
    process, and stores what `plan` counts for it on such a torch (twice a sharded run's)."""
    run_gloo(_without_mesh, 4, 2, _against_one_process, 2)
    out = tmp_path / "bytes.json"
    run_gloo(_without_mesh, 4, 2, _storage_bytes, [], out)
    doc = json.loads(out.read_text())
    ranks, plan = doc["ranks"], doc["plan"]
    assert plan["experts_sharded"] is False and plan["padding_replicas"] == 0
    # 2 layers x 4 local experts x (w_gate_up [32, 32] + w_down [32, 16]) fp32, whole
    assert {r["stored"] for r in ranks} == {2 * 4 * (32 * 32 + 32 * 16) * 4}
    assert plan["expert_params_per_rank"] * 4 == ranks[0]["stored"]


def _storage_bytes(rank, world, ep, extra, out):
    """Each rank's expert-stack weights as FSDP2 stores them (the padded shard under the
    DTensor's local view) beside the planner's count for one rank."""
    from moegraph_cli.distributed.model import expert_parameters
    from moegraph_cli.plan.parallel import Parallel, static_per_rank
    from moegraph_cli.train.runspec import build_model

    spec, rt = _setup(ep, extra)
    model = build_model(spec, rt.device, rt=rt)
    stacks = expert_parameters(model)
    figures = {"rows": sum(_local(p).shape[0] for p in stacks),
               "stored": sum(_local(p).untyped_storage().nbytes() for p in stacks)}
    everyone = rt.gather_all(figures)
    if rank == 0:
        _, plan = static_per_rank(spec.profile, Parallel(world, ep))
        out.write_text(json.dumps({"ranks": everyone, "plan": plan}))


@pytest.mark.parametrize("ffn,dim", [(16, 1), (17, 0)])
def test_replicas_past_the_local_experts(tmp_path, ffn, dim):
    """4 ranks, ep 1, 2 experts, so 4 replicas of 2 experts. Where 4 divides every stack's
    rows (2F = 32, H = 32) the stacks shard on dim 1 and each rank stores half an expert;
    where not (2F = 34) they shard on dim 0, ranks 0 and 1 get one expert each, and ranks 2
    and 3 none, yet store one expert's padded shard. Either way what `plan` counts and says
    (plan/parallel.expert_dim, padding_replicas)."""
    out = tmp_path / "bytes.json"
    run_gloo(_storage_bytes, 4, 1, ["model.num_experts=2", f"model.moe_intermediate_size={ffn}"],
             out)
    doc = json.loads(out.read_text())
    ranks, plan = doc["ranks"], doc["plan"]
    one_expert = 2 * (2 * ffn * 32 + 32 * ffn) * 4  # 2 layers, fp32 w_gate_up + w_down
    assert plan["expert_shard_dim"] == dim
    if dim == 1:  # 2 layers x 2 stacks x both experts' rows, a quarter of each
        assert [r["rows"] for r in ranks] == [8] * 4
        assert {r["stored"] for r in ranks} == {one_expert // 2}
        assert plan["padding_replicas"] == 0
    else:  # whole experts, on the first two ranks only
        assert [r["rows"] for r in ranks] == [4, 4, 0, 0]
        assert {r["stored"] for r in ranks} == {one_expert}
        assert plan["padding_replicas"] == 2
    assert plan["expert_params_per_rank"] * 4 == ranks[0]["stored"]
    assert plan["expert_replicas"] == 4


def _load_checkpoint(rank, world, ep, path, dim):
    from moegraph_cli.distributed.model import expert_parameters
    from moegraph_cli.models import MoeCausalLM
    from moegraph_cli.models.common.init import shard_dim
    from moegraph_cli.train.runspec import build_model

    spec, rt = _setup(ep, checkpoint=str(path))
    model = build_model(spec, rt.device, rt=rt)
    want = dim if experts_sharded(world, ep) else 0
    assert {shard_dim(p) for p in expert_parameters(model)} == {want}
    full = dict(MoeCausalLM.from_pretrained(path, dtype="float32").named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(_whole(name, p, rt), full[name].detach()), name


@pytest.mark.parametrize("world,ep,experts", [(4, 2, 8), (2, 1, 8), (4, 2, 2), (4, 1, 2)])
def test_checkpoint_fills_the_expert_shards(tmp_path, world, ep, experts):
    """A checkpoint (seed 11, not the run's seed) read shard by shard: gathered whole, every
    parameter is bitwise the one-process load. With 2 experts the stacks shard on dim 1 and
    are read a layer at a time, whole, then cut to this rank's rows."""
    from moegraph_cli.io.checkpoint_save import save_checkpoint
    from moegraph_cli.models import MoeCausalLM
    from moegraph_cli.train.runspec import resolve

    cfg = resolve("tiny-qwen3-moe", None, SMALL + [f"model.num_experts={experts}"]).profile.model
    state = MoeCausalLM.from_config(cfg, seed=11, dtype=torch.float32).state_dict()
    save_checkpoint(state, cfg, tmp_path / "ckpt", max_shard_bytes=8192)
    run_gloo(_load_checkpoint, world, ep, tmp_path / "ckpt", 1 if experts == 2 else 0)


def _graphed_against_eager(rank, world, ep, extra, steps):
    from moegraph_cli import grads
    from moegraph_cli.train.harness import build_session, capture_into, make_trainer
    from moegraph_cli.train.runspec import build_model
    from moegraph_cli.train.trainer import batches

    spec, rt = _setup(ep, extra)
    eager = build_model(spec, rt.device, rt=rt)
    graphed = build_model(spec, rt.device, rt=rt)
    te, tg = make_trainer(eager, LR, 0.0, rt), make_trainer(graphed, LR, 0.0, rt)
    session = build_session(graphed, ["attn", "moe"], "shared", rt=rt)
    session.warmup_iters = 1  # the emulated backend compiles nothing (and Triton interprets)
    assert capture_into(graphed, session, next(batches(128, 2, 16, 0, "cpu", rank=rank,
                                                       world=world)), rt), session.failure
    tg.session = session
    moe = [s for s in session.scopes if s.kind == "moe"]
    # sharded experts are graph inputs (FSDP2 re-allocates their unsharded storage); whole
    # ones are read in place
    moving = [{"w_gate_up", "w_down"} <= set(s.moving_names) for s in moe]
    assert moving == [experts_sharded(world, ep)] * len(moe)
    assert not any(grads.marked(p) for p in graphed.parameters())  # no gradient sinks
    ie = batches(128, 2, 16, 1, "cpu", rank=rank, world=world)
    ig = batches(128, 2, 16, 1, "cpu", rank=rank, world=world)
    for _ in range(steps):
        assert te.step(next(ie)).item() == tg.step(next(ig)).item()
        for (n, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
            assert torch.equal(_local(a.grad), _local(b.grad)), n
            assert torch.equal(_local(a), _local(b)), n
    tot = session.stats()["totals"]
    assert tot["replayed"] == steps * len(session.scopes) and tot["fallback"] == 0


@pytest.mark.parametrize("world,ep,backend,steps,extra", [
    (4, 2, "reference", 2, []),
    (4, 2, "reference", 1, ["model.num_experts=2"]),  # sharded on dim 1
    pytest.param(2, 1, "permute_free", 1, [], marks=pytest.mark.slow),  # Triton interprets
])
def test_graphed_equals_eager_bitwise_with_sharded_experts(world, ep, backend, steps, extra):
    """lr > 0, experts sharded over 2 replicas: both expert backends hand the sharded
    experts' gradients back through autograd, never into a buffer FSDP2 does not read;
    losses, gradients and updated weights bitwise equal."""
    run_gloo(_graphed_against_eager, world, ep, [f"moe.backend={backend}", *extra], steps)


def test_verify_nproc4_ep2_against_one_process():
    """`moegraph verify --nproc 4 --ep 2 --reference single`: experts sharded over 2
    replicas, graphs (emulated) against eager bitwise on every rank, and the job's losses
    equal one process's."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MOEGRAPH_ERROR_DIR")}
    r = subprocess.run([sys.executable, "-m", "moegraph_cli.app", "verify", "--nproc", "4",
                        "--ep", "2", "--reference", "single", "--no-lr0", "--steps", "2",
                        "--tolerance", "1e-5", "--json",
                        *[a for o in SMALL for a in ("--set", o)]],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["world_size"] == 4 and doc["ep"] == 2 and doc["passed"], doc["verdict"]
    assert doc["reference"]["kind"] == "single" and doc["reference"]["max_rel"] <= 1e-5
    assert all(row["bitwise_equal"] and row["counters"]["fallback"] == 0
               for row in doc["ranks"])
