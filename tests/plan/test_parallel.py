"""One rank of a distributed run (plan/parallel.py): (1, 1) is the single process to the byte;
the static memory of a rank by hand for Qwen3-30B-A3B; FSDP2 shards and the EP moe scope's
saved tensors against a real sharded model and a real EP scope (gloo, two processes); the
FSDP2 working set and moving-parameter buffers; the CLI's --nproc/--ep; plans refused across
rank layouts."""

from __future__ import annotations

import dataclasses
import json
import weakref

import pytest
import torch
import torch.distributed as dist
import yaml
from cli_util import run_cli
from torch_caps import needs_mesh
from gloo_util import run_gloo

from moegraph_cli.config import load_profile
from moegraph_cli.errors import UsageError
from moegraph_cli.plan.memory import step_model
from moegraph_cli.plan.runkey import run_key, same_run
from moegraph_cli.plan.scope_memory import recomputed, rms_saved
from moegraph_cli.plan.simulation import (FRAGMENTATION, MEDIUM_SEGMENT, MEDIUM_SEGMENTS_PER_POOL,
                                          STRATEGIES)
from moegraph_cli.plan.parallel import (Parallel, moe_memory_ep, padding_replicas, shard_numel,
                                        static_per_rank)
from moegraph_cli.plan.planfile import load_plan
from moegraph_cli.plan.planner import plan_command
from moegraph_cli.train.runspec import resolve
from moegraph_cli.report.summary import static_memory

GiB = 2**30
QWEN = "qwen3-30b-a3b"
SEQ_1K = ["run.seq_len=1024"]  # batch 1 x 1024 tokens per rank


# -- (1, 1) is today's single process ------------------------------------------------------
@pytest.mark.parametrize("name,overrides", [
    ("tiny-qwen3-moe", []), ("tiny-qwen3-moe", ["moe.mode=capacity"]),
    ("tiny-qwen3-moe", ["run.dtype=float32", "model.mlp_only_layers=[1]"]),
    (QWEN, SEQ_1K)])
def test_one_process_is_unchanged(name, overrides):
    prof = load_profile(name, overrides)
    plain, one = step_model(prof), step_model(prof, parallel=Parallel(1, 1))
    assert one.fsdp is None and one.parallel is None
    assert one.static == plain.static and one.kinds == plain.kinds and one.tail == plain.tail
    assert static_per_rank(prof, Parallel())[0] == static_memory(prof.model, prof.run.dtype)
    n = len(plain.scopes)
    for strategy in STRATEGIES:
        for cap in [(False,) * n, (True,) * n, tuple(i % 3 == 0 for i in range(n))]:
            assert one.predict(cap, strategy) == plain.predict(cap, strategy)
    b = one.static_breakdown
    assert b["dense_bytes"] + b["expert_bytes"] + b["buffer_bytes"] == plain.static["total"]


# -- static memory of one rank -------------------------------------------------------------
def test_static_per_rank_qwen3_30b_by_hand():
    prof = load_profile(QWEN, SEQ_1K)
    V, H, L, E, F = 151936, 2048, 48, 128, 768
    attn = 4096 * H + 512 * H + 512 * H + H * 4096 + H + 128 + 128  # q k v o, 3 norms
    dense = 2 * V * H + H + L * (attn + H + E * H)  # embed, head, final norm; + post norm, router
    experts = L * E * (2 * F * H + H * F)
    assert (dense, experts) == (1_541_093_376, 28_991_029_248)
    full = step_model(prof).static["total"]
    rope = 2 * 1024 * 128 * 2
    assert full == 8 * (dense + experts) + rope  # bf16 x (weight, grad, exp_avg, exp_avg_sq)

    rank = step_model(prof, parallel=Parallel(8, 8))
    b = rank.static_breakdown
    # every dense dim 0 here divides by 8: rank 0 holds exactly an eighth (torch.chunk)
    assert b["dense_params_per_rank"] == dense // 8 == 192_636_672
    assert b["local_experts"] == 16
    assert b["expert_params_per_rank"] == L * 16 * 3 * F * H == experts // 8
    assert rank.static["total"] == 8 * (dense // 8 + experts // 8) + rope
    assert b["dense_bytes"] == 8 * dense // 8 and b["expert_bytes"] == 8 * experts // 8
    assert rank.static["total"] / full == pytest.approx(1 / 8, rel=1e-4)
    print(f"\nqwen3-30b-a3b static: one process {full / GiB:.2f} GiB, a rank of 8 (ep 8) "
          f"{rank.static['total'] / GiB:.2f} GiB (dense {b['dense_bytes'] / GiB:.2f} + "
          f"experts {b['expert_bytes'] / GiB:.2f})")
    # ep 2 on 8 ranks: dense still over 8, experts over 2 (replicated over 4)
    two = step_model(prof, parallel=Parallel(8, 2)).static_breakdown
    assert two["dense_params_per_rank"] == dense // 8 and two["local_experts"] == 64


def test_uneven_shards_plan_for_rank_0():
    """tiny: vocab 32000 and q/k norms [64] over 3 ranks give torch.chunk's ceil rows."""
    prof = load_profile("tiny-qwen3-moe")
    assert shard_numel([32000, 512], 3) == 10667 * 512 and shard_numel([64], 3) == 22
    assert shard_numel([5], 8) == 1 and shard_numel([], 3) == 1
    _, b = static_per_rank(prof, Parallel(3, 1))
    per_layer = (171 * 512 + 86 * 512 + 86 * 512 + 171 * 512 + 171 + 22 + 22  # q k v o, norms
                 + 171 + 3 * 512)  # post norm, router [8, 512]
    assert b["dense_params_per_rank"] == 2 * 10667 * 512 + 171 + 2 * per_layer
    assert b["local_experts"] == 8  # ep 1: every rank holds every expert


def test_padding_replicas_follow_torch_chunk():
    """A replica holds only padding where torch.chunk of the local experts leaves it none."""
    for experts in range(0, 9):
        for replicas in range(1, 19):
            chunks = torch.chunk(torch.arange(experts), replicas) if experts else ()
            empty = replicas - len([c for c in chunks if c.numel()]) if experts else 0
            assert padding_replicas(experts, replicas) == (0 if replicas == 1 else empty)


@needs_mesh
def test_expert_memory_keeps_falling_past_one_expert_a_replica():
    """deepseek-v3 at ep 64 holds 4 experts a layer a rank: over 4 replicas (256 ranks) whole
    experts, over 16 (1024 ranks) the rows of each, so the experts' bytes still fall 4x; the
    plan says which, in the text and in --json."""
    prof = load_profile("deepseek-v3")
    b256 = static_per_rank(prof, Parallel(256, 64))[1]
    b1024 = static_per_rank(prof, Parallel(1024, 64))[1]
    assert (b256["expert_shard_dim"], b256["padding_replicas"]) == (0, 0)
    assert (b1024["expert_shard_dim"], b1024["padding_replicas"]) == (1, 0)
    assert b1024["expert_bytes"] * 4 == b256["expert_bytes"]
    assert b256["expert_bytes"] * 4 == static_per_rank(prof, Parallel(64, 64))[1]["expert_bytes"]
    args = ["plan", "-p", "deepseek-v3", "--budget", "120GiB", "--nproc", "1024", "--ep", "64",
            "--set", "run.batch=1", "--set", "run.seq_len=1024"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "4 experts a layer, each expert's rows sharded over 16 replicas" in out
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    assert json.loads(out)["static_breakdown"]["expert_shard_dim"] == 1


@needs_mesh
def test_experts_whole_on_each_replica_without_a_per_parameter_mesh(monkeypatch):
    """On a torch whose FSDP2 has no per-parameter mesh (2.11), 1 < ep < world keeps every
    expert whole on each replica (distributed/layout.experts_sharded): the plan counts them
    whole, leaves them out of the layers' units, charges the trainer's fp32 all-reduce copy,
    and says so. ep 1 and ep == world are the same on any torch."""
    from moegraph_cli.distributed import layout
    from moegraph_cli.plan.parallel import fsdp_layout

    prof = load_profile(QWEN)
    sharded = static_per_rank(prof, Parallel(16, 8))[1]
    ep1 = static_per_rank(prof, Parallel(16, 1))[1]
    monkeypatch.setattr(layout, "per_parameter_mesh", lambda: False)
    whole = static_per_rank(prof, Parallel(16, 8))[1]
    assert sharded["experts_sharded"] and not whole["experts_sharded"]
    assert whole["expert_bytes"] == 2 * sharded["expert_bytes"]
    assert static_per_rank(prof, Parallel(16, 1))[1] == ep1
    f = fsdp_layout(prof, Parallel(16, 8))
    assert f.replicated_experts and not f.kind_dense["moe"] > 128 * 2048 + 2048
    assert all(u.rows == 0 for u in f.layers)
    assert not fsdp_layout(prof, Parallel(16, 1)).replicated_experts
    code, out, err = run_cli("plan", "-p", QWEN, "--budget", "120GiB", "--nproc", "16",
                             "--ep", "8", "--set", "run.seq_len=1024")
    assert code == 0, err
    assert "16 experts a layer, whole on each of 2 replicas (this torch's FSDP2 has no " \
        "per-parameter mesh; their gradients are all-reduced)" in " ".join(out.split())


def test_rows_that_do_not_split_leave_replicas_padding():
    """tiny's 8 experts over 16 replicas (ep 1) with F = 17: 2F = 34 does not split 16 ways,
    so whole experts, one a replica on 8 of them and only padding on the other 8."""
    prof = load_profile("tiny-qwen3-moe", ["model.moe_intermediate_size=17"])
    b = static_per_rank(prof, Parallel(16, 1))[1]
    assert (b["expert_shard_dim"], b["expert_replicas"], b["padding_replicas"]) == (0, 16, 8)
    assert b["expert_params_per_rank"] == static_per_rank(prof, Parallel(8, 1))[1][
        "expert_params_per_rank"]  # one expert a layer either way
    code, out, err = run_cli("plan", "-p", "tiny-qwen3-moe", "--budget", "10GiB", "--nproc", "16",
                             "--set", "model.moe_intermediate_size=17")
    assert code == 0, err
    assert ("8 experts a layer, sharded over 16 replicas by whole experts: 8 of them hold only "
            "padding, so this stays at one expert a layer past 8 replicas") in out


# -- against the real thing: FSDP2 shards and the EP scope's saved tensors (gloo) ----------
def _rank_checks(rank, world):
    from sharded_util import expert_ranges, fsdp_model, tiny_cfg

    from moegraph_cli.distributed.model import is_sharded

    # 1. FSDP2's padded shard storage on this rank = the plan's rank-0 dense shard
    cfg = tiny_cfg()
    model = fsdp_model(cfg, expert_ranges(cfg.num_experts, world)[rank])
    padded, seen = 0, set()
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is not None and id(group) not in seen:  # one group: the norm and the head
            seen.add(id(group))
            padded += sum(p._sharded_param_data.numel() for p in group.fsdp_params)
    assert sum(p.to_local().numel() for p in model.parameters() if is_sharded(p)) <= padded
    prof = dataclasses.replace(load_profile("tiny-qwen3-moe"), model=cfg)
    assert padded == static_per_rank(prof, Parallel(world, world))[1]["dense_params_per_rank"]

    # 2. the EP moe scope (permute-free, Triton interpreter, bf16): what autograd keeps;
    # Qwen2-MoE's with its shared expert (dense, on the rank's own tokens) too
    for name, extra in [("tiny-qwen3-moe", []),
                        ("tiny-qwen2-moe", ["model.shared_expert_intermediate_size=48"])]:
        _ep_scope_saved(rank, world, name, extra)


def _ep_scope_saved(rank, world, name, extra, recompute="none"):
    from moegraph_cli.models.common.ffn import MoeScope
    from moegraph_cli.moe.ep import EpGroup

    prof = load_profile(name, [
        "run.dtype=bfloat16", "run.seq_len=32", "run.batch=1", "moe.backend=permute_free",
        "model.hidden_size=64", "model.moe_intermediate_size=32", "model.num_hidden_layers=1",
        "model.vocab_size=128", *extra])
    ep = EpGroup(dist.group.WORLD, world, rank, prof.model.num_experts)
    torch.manual_seed(rank)
    scope = MoeScope(prof.model, prof.moe, ep).to(torch.bfloat16)
    scope.recompute = recompute
    with torch.no_grad():
        for p in scope.parameters():
            p.normal_(0, 0.05)
    h = torch.randn(1, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in scope.parameters()}
    skip.add(h.untyped_storage().data_ptr())
    packed = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            packed.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, stats = scope(h)
    live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (r() for r in packed) if t is not None}
    assert sum(live.values()) == recomputed(moe_memory_ep(prof, Parallel(world, world), "cpu"),
                                            recompute).saved
    (out.float().sum() + stats.sum()).backward()  # every rank joins the backward collectives


def test_shards_and_ep_saved_bytes_match_real_ranks():
    run_gloo(_rank_checks, 2)


def _kept_act_saved(rank, world):
    _ep_scope_saved(rank, world, "tiny-qwen3-moe", [], "keep")


def test_ep_saved_bytes_with_the_activation_kept():
    """The `keep` mode (FC1's activation kept): the EP formula counts A [S, F] too."""
    run_gloo(_kept_act_saved, 2)


# -- the EP moe scope, FSDP2 working set and moving buffers ----------------------------
def test_ep_moe_scope_qwen3_by_hand():
    """P = 2, T = 1024: R = 2048 received rows, E_l = 64; dropless slots for R*min(k, E_l) =
    16384 routes: BM = 128, S = (16384/128 + 64) * 128 = 24576."""
    prof = load_profile(QWEN, SEQ_1K)
    m = moe_memory_ep(prof, Parallel(2, 2), "cuda")
    T, R, H, E, k, F, S = 1024, 2048, 2048, 128, 8, 768, 24576
    router = rms_saved(T, H, 2, True, True) + 2 * T * H + 4 * T * E + 8 * T * k + 4 * T * k \
        + 4 * T  # the fused post norm (CUDA): rstd; x is the scope's input
    route_list = 8 * (S + 1) + 4 * (S // 128) + 4 * R * k + 8 * 64 + 8
    assert m.saved == router + 2 * R * H + 2 * R * k + 2 * S * 2 * F + route_list
    assert m.param_grads == 2 * (64 * 3 * F * H + E * H + H)  # local experts, router, norm
    # capacity: C = ceil(1024*8*1.25/128) = 80 per expert at the source, P*C = 160 -> 256
    cap = moe_memory_ep(load_profile(QWEN, SEQ_1K + ["moe.mode=capacity"]), Parallel(2, 2))
    S_cap = 64 * 256
    assert m.saved - cap.saved == 2 * (S - S_cap) * 2 * F + 8 * (S - S_cap) \
        + 4 * (S // 128 - S_cap // 128)


def test_head_reduce_scatter_and_moving_buffers_by_hand():
    """8 ranks, everything captured in a shared pool: the eager part's worst moment is the
    head unit's reduce-scatter (the final norm and the lm head, distributed/model.py): its
    unsharded params and grads, the fp32 flat input and output shard, and the last layer's
    unit its backward prefetched, beside the residual stream (the logits died with the loss's
    backward). The embedding's unit is not gathered then."""
    prof = load_profile(QWEN, SEQ_1K)
    model = step_model(prof, parallel=Parallel(8, 8))
    n = len(model.scopes)
    p = model.predict((True,) * n, "shared")
    head = 151936 * 2048 + 2048
    shard = 18992 * 2048 + 256  # ceil(151936 / 8) rows of the head, 2048 / 8 of the norm
    assert (model.fsdp.head.numel, model.fsdp.head.shard) == (head, shard)
    assert (model.fsdp.embed.numel, model.fsdp.embed.shard) == (151936 * 2048, 18992 * 2048)
    assert model.fsdp.root.numel == 0
    # + FSDP2's side-stream caches: the largest unit's gather (b), the head's, and its fp32
    # shard plus bf16 cast
    side = 2 * 8 * shard + (4 + 2) * shard
    assert model.fsdp.side_streams() == side
    last = model.fsdp.layers[47]
    prefetch = 2 * (last.numel + last.gathered)
    dyn = 2 * 2 * head + 4 * 8 * shard + 4 * shard + prefetch + model.stream + side
    assert p.worst_moment == "reduce-scatter of the head"
    assert p.eager_peak == int(dyn * (1 + FRAGMENTATION)) + p.io_bytes + model.runtime_graph \
        + MEDIUM_SEGMENTS_PER_POOL * MEDIUM_SEGMENT
    # I/O: layer 0's input, layer 47's grad-output, 48 router-statistics grads, and ONE set
    # of value + grad buffers per kind (attention params; router + post norm)
    attn = 4096 * 2048 * 2 + 512 * 2048 * 2 + 2048 + 256
    moe_dense = 128 * 2048 + 2048
    assert p.io_bytes == 2 * model.stream + 48 * 8 * 128 + 2 * 2 * (attn + moe_dense)
    only_attn = tuple(r.kind == "attn" and r.layer in (0, 5) for r in model.scopes)
    q = model.predict(only_attn, "shared")
    assert q.io_bytes == 4 * model.stream + 2 * 2 * attn  # not once per captured layer
    # the largest single block is the head's fp32 reduce-scatter input
    assert p.headroom == 4 * 8 * shard


def test_eager_step_of_a_rank_by_hand():
    """2 ranks, nothing captured: the worst moment is the head unit's reduce-scatter (the
    fused loss keeps no fp32 [T, V]; its logits are gone by then), over every layer's saved
    activations, with the head's unsharded parameters (kept from its forward) and grads, its
    fp32 reduce-scatter buffers and the last layer's prefetched unit."""
    model = step_model(load_profile(QWEN, SEQ_1K), parallel=Parallel(2, 2))
    n = len(model.scopes)
    none = model.predict((False,) * n, "shared")
    t, a, m = model.tail, model.kinds["attn"], model.kinds["moe"]
    assert t["loss_bwd_transient"] == 0 and t["loss_saved"] == 12 * 1024
    head = 151936 * 2048 + 2048
    shard = 75968 * 2048 + 1024
    last = model.fsdp.layers[47]
    # every scope's input is kept too: the fused norms (CUDA) save their input x itself
    assert a.saves_input and m.saves_input
    dyn = (model.stream + 48 * (a.saved + m.saved) + n * model.stream
           + 2 * 2 * head + 4 * 2 * shard + 4 * shard + 2 * (last.numel + last.gathered)
           + model.fsdp.side_streams())
    assert none.worst_moment == "reduce-scatter of the head"
    assert none.eager_peak == int(dyn * (1 + FRAGMENTATION)) + model.runtime \
        + MEDIUM_SEGMENTS_PER_POOL * MEDIUM_SEGMENT
    # the last MoE layer's backward, next: the head resharded and its grads freed by then
    m_top = (model.stream + 48 * (a.saved + m.saved) + n * model.stream
             + model.fsdp.working_set(47, -1) + m.bwd_transient + model.fsdp.side_streams())
    assert m_top < dyn
    assert m.bwd_transient > m.param_grads  # returned, not written, on a rank
    every = model.predict((True,) * n, "shared")
    assert every.pool_bytes > 48 * (a.saved + m.saved)  # the activations moved into the pool
    assert every.worst_moment == "reduce-scatter of the head"


def test_tied_head_keeps_the_root_whole_step():
    """A tied head (distributed/model.py keeps the embedding and the final norm in the root):
    the root's unsharded parameters live the whole step and its reduce-scatter runs last."""
    prof = load_profile(QWEN, SEQ_1K + ["model.tie_word_embeddings=true"])
    model = step_model(prof, parallel=Parallel(8, 8))
    assert model.fsdp.embed is None and model.fsdp.head is None
    assert model.fsdp.root.numel == 151936 * 2048 + 2048
    p = model.predict((True,) * len(model.scopes), "shared")
    assert p.worst_moment == "reduce-scatter of the root"


def test_own_units_lower_the_peak_where_people_train():
    """The embedding's and the head's own units against the root holding both (the tied
    layout's moments with the untied sizes): lower at 1 x 4096 and 4 x 4096 a rank."""
    from moegraph_cli.plan.parallel import FsdpUnit

    for seq in (["run.seq_len=4096"], ["run.seq_len=4096", "run.batch=4"]):
        model = step_model(load_profile(QWEN, seq), parallel=Parallel(8, 8))
        n = len(model.scopes)
        own = [model.predict((c,) * n, "shared").eager_peak for c in (True, False)]
        f = model.fsdp
        f.root = FsdpUnit("root", f.embed.numel + f.head.numel, f.embed.shard + f.head.shard, 8)
        f.embed = f.head = None
        root = [model.predict((c,) * n, "shared").eager_peak for c in (True, False)]
        assert all(a < b for a, b in zip(own, root)), (seq, own, root)


# -- plan --nproc/--ep -----------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def test_cli_plan_eight_ranks_fits_80gib():
    code, stdout, stderr = run_cli("plan", "--profile", QWEN, "--nproc", "8", "--ep", "8",
                                   "--budget", "80GiB", "--set", "run.seq_len=1024", "--json")
    assert code == 0, stderr
    r = json.loads(stdout)
    assert (r["world"], r["ep"]) == (8, 8) and (r["key"]["world"], r["key"]["ep"]) == (8, 8)
    assert r["predicted_peak"] + r["headroom_bytes"] <= 80 * GiB
    captured = sum(len(layer["scopes"]) for layer in r["layers"])
    assert captured > 0
    assert r["static_breakdown"]["local_experts"] == 16
    print(f"\n8 ranks, ep 8, 1x1024: static {_gib(r['static_bytes'])}, eager-phase peak "
          f"{_gib(r['eager_phase_peak'])}, predicted {_gib(r['predicted_peak'])} + headroom "
          f"{_gib(r['headroom_bytes'])}, pool {r['pool']}, {captured}/96 scopes captured")


def test_cli_plan_eight_ranks_at_4096_needs_capacity_mode_or_recompute():
    """Dropless EP sizes each rank's Y1 for every received route landing on it: at T = 4096
    and P = 8 that is 262144 routes, 811 MB a layer; without recompute only capacity mode fits
    80 GiB, with it (run.recompute auto) dropless fits too."""
    code, _, stderr = run_cli("plan", "--profile", QWEN, "--nproc", "8", "--ep", "8",
                              "--budget", "80GiB", "--set", "run.seq_len=4096",
                              "--set", "run.recompute=none")
    assert code == 1 and len(stderr.strip().splitlines()) == 1  # too small a budget: exit 1
    assert "per rank of --nproc 8 --ep 8 even with nothing captured (run.recompute=none" \
        in stderr
    code, stdout, stderr = run_cli("plan", "--profile", QWEN, "--nproc", "8", "--ep", "8",
                                   "--budget", "80GiB", "--set", "run.seq_len=4096", "--json")
    assert code == 0, stderr
    r = json.loads(stdout)
    assert r["required_budget"] <= 80 * GiB
    assert any(layer["recompute"] for layer in r["layers"])
    code, stdout, stderr = run_cli("plan", "--profile", QWEN, "--nproc", "8", "--ep", "8",
                                   "--budget", "80GiB", "--set", "moe.mode=capacity",
                                   "--set", "run.seq_len=4096", "--json")
    assert code == 0, stderr
    r = json.loads(stdout)
    assert r["required_budget"] <= 80 * GiB and any(layer["scopes"] for layer in r["layers"])


def test_two_ranks_fit_an_h200_but_not_with_per_entry_pools():
    spec = resolve(QWEN, overrides=SEQ_1K)
    budget = 139 * GiB
    r = plan_command(spec, budget=str(budget), nproc=2, ep=2)
    assert r["required_budget"] <= budget and any(layer["scopes"] for layer in r["layers"])
    model = step_model(spec.profile, parallel=Parallel(2, 2))
    every = model.predict((True,) * len(model.scopes), "per_entry")
    assert every.peak > budget
    print(f"\n2 ranks, ep 2, 1x1024: static {_gib(r['static_bytes'])}, eager-phase peak "
          f"{_gib(r['eager_phase_peak'])}, plan {r['pool']} {_gib(r['predicted_peak'])}, "
          f"per_entry on all 48 layers {_gib(every.peak)}")


@pytest.mark.parametrize("args,needle", [
    (["--nproc", "8", "--ep", "3"], "--ep 3 does not divide the world size 8"),
    (["--nproc", "10", "--ep", "5"], "--ep 5 does not divide the model's 128 experts"),
    (["--ep", "2"], "--ep 2 needs several ranks"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--nproc", "2", "--calibration", "cal.yaml"], "--calibration is measured in one process"),
])
def test_cli_plan_bad_ranks_exit_2(args, needle):
    code, _, stderr = run_cli("plan", "--profile", QWEN, "--budget", "80GiB", *args)
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1 and needle in stderr, stderr


# -- keys: a plan is for one rank layout -------------------------------------------------------
def test_run_key_carries_ranks_and_old_keys_are_one_process():
    prof = load_profile("tiny-qwen3-moe")
    key = run_key(prof)
    assert (key["world"], key["ep"]) == (1, 1)
    old = {k: v for k, v in key.items() if k not in ("world", "ep")}
    assert same_run(old, key) and not same_run(old, run_key(prof, 2, 2))
    assert not same_run(run_key(prof, 2, 1), run_key(prof, 2, 2))


def test_plan_for_two_ranks_refused_for_one_and_back(tmp_path):
    spec = resolve("tiny-qwen3-moe")
    two = tmp_path / "two.yaml"
    plan_command(spec, budget="1.5GiB", nproc=2, ep=2, out=str(two))
    raw = yaml.safe_load(two.read_text())
    assert (raw["key"]["world"], raw["key"]["ep"]) == (2, 2)
    assert raw["static_breakdown"]["local_experts"] == 4
    assert load_plan(two, spec.profile, world=2, ep=2).predicted_peak == raw["predicted_peak"]
    with pytest.raises(UsageError) as e:
        load_plan(two, spec.profile)
    msg = str(e.value)
    assert "\n" not in msg and "made for --nproc 2 --ep 2, not this run's one process" in msg
    with pytest.raises(UsageError, match=r"--nproc 2 --ep 2, not this run's --nproc 2 --ep 1"):
        load_plan(two, spec.profile, world=2, ep=1)

    one = tmp_path / "one.yaml"
    plan_command(spec, budget="1.5GiB", out=str(one))
    with pytest.raises(UsageError, match=r"made for one process, not this run's --nproc 2 "
                                         r"--ep 2; run `moegraph plan` again with --nproc 2"):
        load_plan(one, spec.profile, world=2, ep=2)
    # a plan written before distributed runs (no world/ep in its key) is a one-process plan
    raw = yaml.safe_load(one.read_text())
    for k in ("world", "ep"):
        del raw["key"][k]
    one.write_text(yaml.safe_dump(raw))
    assert load_plan(one, spec.profile).layer_scopes()
    with pytest.raises(UsageError, match="one process, not this run's --nproc 2"):
        load_plan(one, spec.profile, world=2, ep=2)
    # the run differing too: the general message, with both layouts named
    with pytest.raises(UsageError, match=r"seq_len 512, .*--nproc 2 --ep 2\), not this run "
                                         r".*seq_len 1024"):
        load_plan(two, load_profile("tiny-qwen3-moe", ["run.seq_len=1024"]))


def test_cli_plan_text_names_the_ranks():
    code, stdout, stderr = run_cli("plan", "--profile", QWEN, "--nproc", "8", "--ep", "8",
                                   "--budget", "80GiB", "--set", "run.seq_len=1024")
    assert code == 0, stderr
    assert "one rank of --nproc 8 --ep 8" in stdout
    # 192,636,672 params x 8 bytes
    assert "static per rank: dense 1.44 GiB" in stdout and "(16 experts a layer)" in stdout


def test_expert_shard_dim_rule():
    """Whole experts where the replicas divide them; else rows, only where every stack's rows
    split evenly (FSDP2 shards a dim past 0 only evenly); else whole experts again."""
    from moegraph_cli.distributed.layout import expert_shard_dim
    assert expert_shard_dim(4, 1, {7}) == 0 and expert_shard_dim(4, 4, {7}) == 0
    assert expert_shard_dim(8, 2, {3}) == 0  # 8 % 2 == 0: rows never asked
    assert expert_shard_dim(4, 16, {4096, 7168}) == 1
    assert expert_shard_dim(6, 4, {32, 16}) == 1  # 6 % 4: whole experts would pad
    assert expert_shard_dim(4, 16, {4096, 7160}) == 0  # one stack's rows do not split
    assert expert_shard_dim(1, 3, {30}) == 1 and expert_shard_dim(1, 3, {31}) == 0


@needs_mesh
def test_row_sharded_experts_charge_their_copies():
    """FSDP2 copies a dim-1 shard's all-gather out through a temporary of the stack's size,
    and its gradient into dim-0 order through another: both charged to the layer's unit."""
    from moegraph_cli.plan.parallel import fsdp_layout
    prof = load_profile("deepseek-v3")
    whole, rows = fsdp_layout(prof, Parallel(256, 64)), fsdp_layout(prof, Parallel(1024, 64))
    moe_layer = 5  # past the 3 dense layers
    local = 4 * (2 * 2048 * 7168 + 7168 * 2048)  # 4 experts: w_gate_up + w_down
    assert whole.layers[moe_layer].rows == 0 and rows.layers[moe_layer].rows == local
    assert rows.layers[0].rows == 0  # a dense layer
    unit = rows.layers[moe_layer]
    assert rows.reduce_scatter(unit) == 4 * unit.gathered + 4 * unit.shard + 2 * local
    assert rows.working_set(moe_layer, +1) >= 2 * (unit.numel + unit.gathered + local)
