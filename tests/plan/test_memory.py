"""The memory model: hand-computed sizes for the tiny profile, the saved-activation formulas
against autograd's saved tensors (saved_tensors_hooks, deduplicated by storage) on a CPU
model, and the pool simulation on hand-made scope sizes."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from moegraph_cli.config import load_profile
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.plan.memory import step_model
from moegraph_cli.plan.scope_memory import (ScopeMemory, attn_memory, dp_part_bytes,
                                            expert_slots, moe_memory, recomputed,
                                            route_block)
from moegraph_cli.plan.simulation import (MEDIUM_SEGMENT, MEDIUM_SEGMENTS_PER_POOL, StepModel,
                                          scope_refs)

MiB = 2**20


# -- hand-computed sizes: tiny-qwen3-moe (B=2, S=512, H=512, V=32000, 2 layers, bf16) -----
def test_static_memory_of_tiny_by_hand():
    prof = load_profile("tiny-qwen3-moe")
    embed = 32000 * 512  # and the same again for the untied lm head
    attn = 512 * 512 + 256 * 512 + 256 * 512 + 512 * 512 + 512 + 64 + 64  # q k v o, 3 norms
    moe = 512 + 8 * 512 + 8 * (2 * 256) * 512 + 8 * 512 * 256  # post norm, router, experts
    params = 2 * embed + 2 * (attn + moe) + 512  # + final norm
    assert params == 40_643_328
    model = step_model(prof)
    rope = 2 * 512 * 64 * 2  # cos and sin [S, D] in bf16
    # bf16 weights + grads + AdamW exp_avg + exp_avg_sq: 2 bytes x 4
    assert model.static["total"] == params * 2 * 4 + rope == 325_277_696


def test_scope_io_logits_and_saved_of_tiny_by_hand(monkeypatch):
    monkeypatch.setenv("MOEGRAPH_FUSED", "0")  # the torch norms' saved tensors, on CUDA
    prof = load_profile("tiny-qwen3-moe")
    model = step_model(prof)
    T = 2 * 512
    stream = T * 512 * 2  # one [B,S,H] bf16 buffer
    assert model.stream == stream == 1_048_576
    assert model.tail["logits"] == T * 32000 * 2 == 65_536_000
    assert model.tail["loss_saved"] == 4 * T + 8 * T  # lse (fp32) and labels: no fp32 [T, V]
    assert model.tail["loss_bwd_transient"] == 0  # dlogits overwrite the logits
    a = model.kinds["attn"]
    assert (a.out, a.in_grad) == (stream, stream)
    # attn saved, bf16: input norm (fp32 x, rsqrt, normed, output y), q norm over Q=512,
    # k norm over KV=256, SDPA q and out (8 heads), k and v (its own grouped heads: 4 each;
    # expanded to 8 with MOEGRAPH_ATTN_GQA=expand), logsumexp.
    by_hand = (4 * T * 512 + 4 * T + 2 * T * 512 + 2 * T * 512
               + 4 * T * 512 + 4 * T * 8 + 2 * T * 512
               + 4 * T * 256 + 4 * T * 4 + 2 * T * 256
               + 2 * 2 * T * 512 + 2 * 2 * T * 256 + 4 * T * 8)
    assert a.saved == by_hand == 12_144_640
    m = model.kinds["moe"]
    assert m.out == stream + 2 * 8 * 4  # + router statistics [2, E] fp32
    # permute-free: BM = 128 (N = T*k = 2048 >= 256*E), S = (2048/128 + 8) * 128 = 3072
    S = 3072
    norm_router = 4 * T * 512 + 4 * T + 2 * T * 512 + 2 * T * 512 + 4 * T * 8 + 8 * T * 2 \
        + 4 * T * 2 + 4 * T
    route_list = 8 * (S + 1) + 4 * (S // 128) + 4 * T * 2 + 8 * 8 + 8
    assert m.saved == norm_router + 2 * T * 2 + S * 2 * 256 * 2 + route_list
    # The eager step's worst moment is the lm head's backward: the logits (bf16, now holding
    # their gradient) and dX over every layer's saved activations; no fp32 [T, V] anywhere.
    p = model.predict((False,) * 4, "shared")
    assert p.worst_moment == "lm-head backward"
    assert m.bwd_transient == moe_memory(prof).bwd_transient - m.param_grads  # dW written
    norm_tail = 4 * T * 512 + 4 * T + 2 * T * 512 + 2 * T * 512 + 8 * T
    live = stream + 2 * (a.saved + m.saved) + norm_tail + 65_536_000 + 12 * T
    assert p.eager_phase_peak == model.static["total"] + int((live + stream) * 1.05) \
        + model.runtime + DEFAULT_POOL_SLACK


@pytest.mark.parametrize("paired", ["0", "1"])
def test_dp_part_formula_matches_the_kernels(paired, monkeypatch):
    """dp_part's bytes as the planner counts them, against the buffer moe/experts allocates
    on a GPU (kernels/dact_swiglu.dp_tiles under tile_configs' dA choice; the planner models
    GPU memory only)."""
    import moegraph_kernels.gemm_config as gc
    from moegraph_cli.moe.experts import tile_configs
    from moegraph_kernels.dact_swiglu import dp_tiles
    monkeypatch.setenv("MOEGRAPH_DACT_PAIRED", paired)
    monkeypatch.setattr(gc, "DACT_PAIRED", paired == "1")
    for routes, experts, ffn in [(65536, 128, 768), (8192, 128, 768), (2048, 8, 256),
                                 (65536, 128, 1408), (4096, 16, 1024)]:
        cfg = tile_configs(routes, experts, 2048, ffn, torch.device("cuda"))
        block = route_block(routes, experts, "cuda")
        assert dp_part_bytes(1000, ffn, block, "cuda") == 4 * 1000 * dp_tiles(ffn, cfg.dact)


def test_slot_formula_matches_the_kernels():
    from moegraph_kernels.gemm_config import route_block_m
    from moegraph_kernels.route_align import num_slots

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for routes, experts, cap in [(2048, 8, None), (32768, 128, None), (100, 8, None),
                                 (4096, 16, 300), (512, 128, 5)]:
        for dev in (cuda, cpu):
            assert route_block(routes, experts, dev.type) == route_block_m(routes, experts, dev)
            block = route_block(routes, experts, dev.type)
            assert expert_slots(routes, 1, experts, block, cap) == \
                num_slots(routes, experts, block, cap)


# -- saved activations: formula vs autograd's saved tensors ----------------------------------
def measure_saved(prof, modes: dict[str, str] | None = None) -> dict[str, tuple[int, bool]]:
    """Bytes autograd saves per scope during one forward and still holds when it ends, by
    storage, excluding parameters, the rope tables and the scope's input (a flag), with
    every layer's scopes at `modes` ({kind: recompute mode}). Packed tensors are held weakly:
    a node nothing differentiable reaches is freed with what it saved, and its address may be
    reused, so liveness is checked at the end."""
    from moegraph_cli.models.common.recompute import set_recompute

    torch.manual_seed(0)
    model = MoeCausalLM.from_config(prof.model, prof.moe, 0, prof.run.dtype, "cpu")
    if modes:
        set_recompute(model, {i: modes for i in range(len(model.layers))})
    ids = torch.randint(0, prof.model.vocab_size, (prof.run.batch, prof.run.seq_len))
    model.rope_tables(prof.run.seq_len, next(model.parameters()).dtype, "cpu")
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for pair in model._rope_cache.values()
                for t in pair}
    current: list = [None, None]  # scope name, its input's storage
    packed: list[tuple[str, weakref.ref, bool]] = []

    def pack(t):
        st = t.untyped_storage()
        if current[0] is not None and st.data_ptr() not in exclude:
            packed.append((current[0], weakref.ref(t), st.data_ptr() == current[1]))
        return t

    hooks = []
    for name, _, _, module in model.scopes():
        hooks.append(module.register_forward_pre_hook(
            lambda _m, args, n=name: current.__setitem__(
                slice(0, 2), [n, args[0].untyped_storage().data_ptr()]) or None))
        hooks.append(module.register_forward_hook(
            lambda *_: current.__setitem__(slice(0, 2), [None, None]) or None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids)
    for h in hooks:
        h.remove()
    saved: dict[str, dict[int, int]] = {}
    saves_input: dict[str, bool] = {}
    for name, ref, is_input in packed:
        t = ref()
        if t is None:
            continue
        if is_input:
            saves_input[name] = True
        else:
            st = t.untyped_storage()
            saved.setdefault(name, {})[st.data_ptr()] = st.nbytes()
    del out
    return {n: (sum(v.values()), saves_input.get(n, False)) for n, v in saved.items()}


SAVED_CASES = [
    ("float32", "dropless"), ("bfloat16", "dropless"), ("float32", "capacity"),
]


@pytest.mark.parametrize("dtype,mode", SAVED_CASES)
def test_saved_formula_matches_saved_tensors_hooks(dtype, mode):
    """Reference backend on the CPU. Tolerance: 0.5% (the formulas count every tensor; the
    slack is for a library that saves an extra small tensor in some torch version)."""
    overrides = [f"run.dtype={dtype}", "run.seq_len=64", "run.batch=2", "moe.backend=reference",
                 "model.mlp_only_layers=[1]", "model.num_hidden_layers=3",
                 f"moe.mode={mode}", "moe.capacity_factor=8.0"]  # C = N: nothing dropped
    prof = load_profile("tiny-qwen3-moe", overrides)
    measured = measure_saved(prof)
    model = step_model(prof, device_type="cpu")
    assert {n for n in measured} == {r.name for r in scope_refs(prof)}
    for ref in scope_refs(prof):
        formula = model.kinds[ref.kind]
        got, input_saved = measured[ref.name]
        assert got == pytest.approx(formula.saved, rel=5e-3), (ref.name, got, formula.saved)
        assert input_saved == formula.saves_input, ref.name
    # Sanity of the comparison itself: scopes really differ, so a wrong kind would fail.
    assert len({measured[r.name][0] for r in scope_refs(prof)}) == 3


FAMILY_CASES = {  # each family's tiny profile with the settings that change what is saved
    "tiny-mixtral": ["model.sliding_window=16"],
    "tiny-olmoe": ["model.clip_qkv=0.5", "model.attention_bias=true"],
    "tiny-qwen2-moe": ["model.mlp_only_layers=[1]"],
    # MLA with a q LoRA and v padded to the q/k head dim; the grouped sigmoid router and the
    # ungated shared expert; a leading dense layer
    "tiny-deepseek-v3": [],
    # MLA without a q LoRA, q/k padded to a wider v
    "tiny-deepseek-v3 ": ["model.q_lora_rank=null", "model.v_head_dim=128",
                          "model.first_k_dense_replace=0"],
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("profile", list(FAMILY_CASES))
def test_saved_formula_of_each_family(profile, dtype):
    """The families' attention variants (no q/k norm, q/k norm over the projection, clamped
    q/k/v, a sliding window) and the shared expert, against autograd's saved tensors."""
    prof = load_profile(profile.strip(), [f"run.dtype={dtype}", "run.seq_len=64", "run.batch=2",
                                  "moe.backend=reference", "model.num_hidden_layers=3",
                                  *FAMILY_CASES[profile]])
    measured = measure_saved(prof)
    model = step_model(prof, device_type="cpu")
    for ref in scope_refs(prof):
        got, input_saved = measured[ref.name]
        assert got == model.kinds[ref.kind].saved, (ref.name, got)
        assert input_saved == model.kinds[ref.kind].saves_input, ref.name


@pytest.mark.parametrize("recompute", ["none", "keep", "fc1"])
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_permute_free_saved_formula(mode, recompute):
    """The Triton path under the interpreter (fp32, small): Y1 [S, 2F] (and A [S, F] in the
    `keep` mode, neither in `fc1`), the weights and the RouteList are what it keeps; the
    formula must match exactly."""
    prof = load_profile("tiny-qwen3-moe", [
        "run.dtype=float32", "run.seq_len=32", "run.batch=1", "moe.backend=permute_free",
        "model.hidden_size=64", "model.moe_intermediate_size=32", "model.num_hidden_layers=1",
        "model.vocab_size=128", f"moe.mode={mode}", "moe.capacity_factor=1.0"])
    got, _ = measure_saved(prof, {"moe": recompute})["layers.0.moe"]
    assert got == recomputed(step_model(prof, device_type="cpu").kinds["moe"], recompute).saved
    if mode == "dropless":  # T=32, H=64, E=8, k=2, N=64, F=32, fp32; CPU slot block 16
        S = (64 // 16 + 8) * 16  # 192
        norm = 4 * 32 + 4 * 32 * 64 + 4 * 32 * 64  # rsqrt, normed, y (fp32 x is the input)
        router = 4 * 32 * 8 + 8 * 64 + 4 * 64 + 4 * 32  # probs, top-k ids, values, their sum
        route_list = 8 * (S + 1) + 4 * (S // 16) + 4 * 64 + 8 * 8 + 8
        y1, act = S * 2 * 32 * 4, S * 32 * 4
        f_scale = {"none": y1, "keep": y1 + act, "fc1": 0}[recompute]
        assert got == norm + router + 4 * 64 + route_list + f_scale \
            == 69_760 - y1 + f_scale


def test_attn_saved_scales_with_tokens():
    a1 = attn_memory(load_profile("tiny-qwen3-moe", ["run.seq_len=128"]))
    a2 = attn_memory(load_profile("tiny-qwen3-moe", ["run.seq_len=256"]))
    assert a2.saved == 2 * a1.saved


def test_capacity_mode_slots_are_static():
    prof = load_profile("tiny-qwen3-moe", ["moe.mode=capacity", "moe.capacity_factor=1.0"])
    m = moe_memory(prof, "cuda")
    # C = ceil(1024*2*1.0/8) = 256 -> S = 8 * round_up(256, 128) = 2048 slots; Y1 = S*2F*2
    dropless = moe_memory(load_profile("tiny-qwen3-moe"), "cuda")
    y1_gap = (3072 - 2048) * 512 * 2
    route_gap = 8 * (3072 - 2048) + 4 * (3072 // 128 - 2048 // 128)
    assert dropless.saved - m.saved == y1_gap + route_gap


# -- the pool simulation on hand-made sizes ----------------------------------------------
DEFAULT_POOL_SLACK = MEDIUM_SEGMENTS_PER_POOL * MEDIUM_SEGMENT
U = 2 * MiB  # one allocator segment; sizes below are in these units so rounding is exact


def toy_model(layers: int = 2) -> StepModel:
    prof = load_profile("tiny-qwen3-moe", [f"model.num_hidden_layers={layers}"])
    model = step_model(prof, fragmentation=0.0)
    model.kinds = {
        "attn": ScopeMemory("attn", saved=10 * U, out=1 * U, in_grad=1 * U, fwd_transient=5 * U,
                            bwd_transient=7 * U, param_grads=0),
        "moe": ScopeMemory("moe", saved=20 * U, out=1 * U, in_grad=1 * U, fwd_transient=8 * U,
                           bwd_transient=30 * U, param_grads=0),
    }
    return model


def test_shared_pool_follows_capture_order():
    p = toy_model().predict((True,) * 4, "shared")
    # forward a0 m0 a1 m1 keeps saved+out: 11, 32, 43, 64; peak inside m1's forward 64+29-21=72
    # backward m1: 64 + 30 = 94 (the largest); then live 45, a1 52, live 36, m0 66, a0 24
    assert p.pools == {"shared": 94 * U + 4 * MEDIUM_SEGMENT}  # 8 graphs: 4 medium segments


def test_per_scope_and_per_entry_pools():
    model = toy_model()
    p = model.predict((True,) * 4, "per_scope")
    # attn pool: fwd 16, live 11, 27 (a1: 11+16), live 22; bwd a1 29, live 13, a0 20 -> 29
    # moe pool: fwd 29, live 21, 50, live 42; bwd m1 72, live 23, m0 53 -> 72
    assert p.pools == {"attn": 29 * U + 4 * MEDIUM_SEGMENT, "moe": 72 * U + 4 * MEDIUM_SEGMENT}
    p = model.predict((True,) * 4, "per_entry")
    # every graph its own pool: forward saved+out+transient, backward its transient, each
    # with one medium (20 MiB) segment of allocator slack
    M = MEDIUM_SEGMENT
    assert p.pools == {"layers.0.attn.fwd": 16 * U + M, "layers.0.attn.bwd": 7 * U + M,
                       "layers.0.moe.fwd": 29 * U + M, "layers.0.moe.bwd": 30 * U + M,
                       "layers.1.attn.fwd": 16 * U + M, "layers.1.attn.bwd": 7 * U + M,
                       "layers.1.moe.fwd": 29 * U + M, "layers.1.moe.bwd": 30 * U + M}
    assert p.pool_bytes == 164 * U + 8 * M


def test_io_buffers_and_chaining():
    model = toy_model()
    stream, stats = model.stream, 8 * 8
    # all four chained: only layer 0 attn's input and layer 1 moe's grad-output, + 2 stats grads
    assert model.predict((True,) * 4, "shared").io_bytes == 2 * stream + 2 * stats
    # attn only: each attn keeps its own input and grad-output buffer
    assert model.predict((True, False, True, False), "shared").io_bytes == 4 * stream


def test_capturing_moves_saved_bytes_from_eager_into_the_pool():
    model = toy_model()
    none = model.predict((False,) * 4, "shared")
    both = model.predict((True,) * 4, "shared")
    streams = model.runtime_graph - model.runtime  # cuBLAS workspaces of the capture streams
    # with every scope captured the eager part holds no scope activations ...
    assert none.eager_peak - both.eager_peak >= 2 * (10 + 20) * U - both.io_bytes - streams
    # ... and the graph phase costs more than the eager one by about the largest transient
    # and the I/O buffers, not by every scope's activations again.
    assert both.peak - none.peak <= 94 * U - 60 * U + both.io_bytes + streams + 4 * U \
        + 4 * MEDIUM_SEGMENT


def test_worked_out_memories_follow_a_replaced_kind_and_the_recompute_modes():
    """StepModel.memories() is worked out once per choice (the planner's search predicts each
    choice thousands of times): a kind replaced afterwards (as a calibration does) and each
    recompute tuple still get their own memories, and predictions equal a fresh model's."""
    prof = load_profile("tiny-qwen3-moe")
    model = step_model(prof)
    before = model.predict((False,) * 4, "shared")
    assert model.memories()[1] is model.kinds["moe"]
    fc1 = dataclasses.replace(model, recompute=("none", "fc1", "none", "fc1"))
    assert fc1.memories()[1] is fc1.memory(1) is not model.kinds["moe"]
    assert model.memories()[1] is model.kinds["moe"]  # the copy's choice is its own
    model.kinds["moe"] = dataclasses.replace(model.kinds["moe"], saved=7 * U)
    assert model.memories()[1].saved == 7 * U
    after = model.predict((False,) * 4, "shared")
    fresh = step_model(prof)
    fresh.kinds["moe"] = dataclasses.replace(fresh.kinds["moe"], saved=7 * U)
    assert after.peak == fresh.predict((False,) * 4, "shared").peak != before.peak


def test_calibration_replaces_formulas():
    prof = load_profile("tiny-qwen3-moe")
    entry = {"key": {}, "scopes": {"attn": {
        "saved_bytes": 5 * U, "out_bytes": U, "in_grad_bytes": U, "fwd_peak_bytes": 9 * U,
        "bwd_peak_bytes": 4 * U, "saves_input": False, "private_pools": [12 * U, 6 * U]}}}
    model = step_model(prof, calibration=entry)
    a = model.kinds["attn"]
    assert (a.saved, a.fwd_transient, a.bwd_transient, a.source) == \
        (5 * U, 3 * U, 4 * U, "calibration")
    p = model.predict((True, False, True, False), "per_entry")
    assert p.pools["layers.0.attn.fwd"] == 12 * U and p.pools["layers.1.attn.bwd"] == 6 * U
    assert model.kinds["moe"].source == "analytical"


def test_calibrated_moe_keeps_its_recompute_rungs():
    """A calibration measures the default mode; the fc1 and keep modes' bytes (exact in the
    formulas) carry over, so a calibrated plan's ladder keeps both rungs."""
    from moegraph_cli.plan.recompute import ladder
    from moegraph_cli.plan.scope_memory import recomputed

    prof = load_profile("tiny-qwen3-moe")
    formula = step_model(prof).kinds["moe"]
    assert formula.fc1_saved > 0 and formula.keep_saved > 0
    measured = formula.saved + 3 * U
    entry = {"key": {}, "scopes": {"moe": {
        "saved_bytes": measured, "out_bytes": formula.out, "fwd_peak_bytes": measured + 9 * U,
        "bwd_peak_bytes": 7 * U, "saves_input": False}}}
    model = step_model(prof, calibration=entry)
    moe = model.kinds["moe"]
    assert moe.source == "calibration"
    assert recomputed(moe, "fc1").saved == measured - formula.fc1_saved
    assert recomputed(moe, "fc1").bwd_transient == \
        formula.fc1_saved + max(formula.fc1_transient, 7 * U)
    assert recomputed(moe, "keep").saved == measured + formula.keep_saved
    modes = [s.mode for s in ladder(model, "auto")[1]]
    assert "fc1" in modes and "none" in modes, modes
    # a measurement smaller than the formula's Y1 cannot free more than was measured
    entry["scopes"]["moe"]["saved_bytes"] = formula.fc1_saved // 2
    small = step_model(prof, calibration=entry).kinds["moe"]
    assert recomputed(small, "fc1").saved == 0


def test_calibrated_offsets_come_from_the_one_layer_measurement():
    prof = load_profile("tiny-qwen3-moe")
    plain = step_model(prof)
    probe_prof = dataclasses.replace(prof, model=dataclasses.replace(prof.model,
                                                                     num_hidden_layers=1))
    probe = step_model(probe_prof)
    base_eager = probe.predict((False, False), "shared").eager_phase_peak
    base_pool = probe.predict((True, True), "shared").pool_bytes
    entry = {"key": {}, "scopes": {},
             "layer_model": {"pools": {"shared": base_pool + 10 * U},
                             "eager_peak_reserved": base_eager + 3 * U}}
    cal = step_model(prof, calibration=entry)
    assert cal.eager_offset == 3 * U and cal.pool_offsets["shared"] == 10 * U
    none = (False,) * 4
    assert cal.predict(none, "shared").peak == plain.predict(none, "shared").peak + 3 * U
    assert cal.predict((True,) * 4, "shared").pool_bytes == \
        plain.predict((True,) * 4, "shared").pool_bytes + 10 * U


def test_sink_attention_priced_at_its_padded_head_dim():
    """GPT-OSS's sinks run SDPA at head dim D + PAD: the planner's saved bytes say so, with
    the pad the attention itself uses."""
    from moegraph_cli.config import load_profile
    from moegraph_cli.models.common.sinks import PAD
    from moegraph_cli.plan import scope_memory as memory

    assert memory.SINK_PAD == PAD
    prof = load_profile("tiny-gpt-oss")
    with_sinks = memory.attn_memory(prof).saved
    shapes = memory.layer_shapes
    try:
        memory.layer_shapes = lambda c, i: {k: v for k, v in shapes(c, i).items()
                                            if k != "attn.sinks"}
        without = memory.attn_memory(prof).saved
    finally:
        memory.layer_shapes = shapes
    c, T = prof.model, prof.run.batch * prof.run.seq_len
    b = 2 if prof.run.dtype == "bfloat16" else 4
    assert with_sinks - without == 4 * b * T * c.num_attention_heads * PAD


def test_fused_norms_save_their_input_and_rstd_only():
    """On CUDA the norms are Triton kernels (models/common/fused.py) that save x and rstd
    [rows] fp32, not x.float() and the normalised value: the tiny attention scope by hand."""
    m = step_model(load_profile("tiny-qwen3-moe")).kinds["attn"]
    T = 2 * 512
    by_hand = (4 * T + 2 * T * 512  # input norm: rstd (x is the scope's input); y
               + 2 * T * 512 + 4 * T * 8  # q head norm: x, rstd per head
               + 2 * T * 256 + 4 * T * 4  # k head norm
               + 2 * 2 * T * 512 + 2 * 2 * T * 256 + 4 * T * 8)  # SDPA q, out; k, v; lse
    assert m.saved == by_hand and m.saves_input


def test_expanded_kv_heads_are_counted_at_the_query_heads(monkeypatch):
    """MOEGRAPH_ATTN_GQA=expand: SDPA keeps K and V at the query heads (8 of 64 dims)."""
    native = step_model(load_profile("tiny-qwen3-moe")).kinds["attn"].saved
    monkeypatch.setenv("MOEGRAPH_ATTN_GQA", "expand")
    expanded = step_model(load_profile("tiny-qwen3-moe")).kinds["attn"].saved
    assert expanded - native == 2 * 2 * (2 * 512) * (512 - 256)
