"""The slot-GEMM variants (GemmConfig tma / persistent / flatten / warp_specialize) against the
default pointer path, kernel by kernel, and end to end against reference_moe.

On the CPU the kernels run in the Triton interpreter (fp32), which runs tensor descriptors and
`tl.range` (ignoring its scheduling hints), so every variant's index arithmetic is exercised:
the live-block list of the persistent loop, the [E*R, C] weight descriptors, the fallbacks.
Each variant computes an output tile with the default's tile shape and K order, so results are
bitwise equal -- except where the interpreter's numpy matmul sums a transposed tile in another
order: the TMA weight tile of fc1 / fc2 ([BN, BK], transposed for the dot). Those are compared
to 1e-6. The `cuda` tests compare bf16 results on the GPU bitwise (same tile, same K order).

Every output buffer starts full of NaN: a live row left unwritten, or a dead block's row
written, shows up.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from routing_cases import moe_inputs

import moegraph_kernels.gemm_config as gc
import moegraph_kernels.gemm_launch as gl
import moegraph_kernels.wgrad as wg
from moegraph_cli.moe.experts import (build_routes, permute_free_moe_with_drops,
                                      poisoned_scratch, tile_configs)
from moegraph_cli.moe.reference import reference_moe
from moegraph_kernels import tma
from moegraph_kernels.dact_swiglu import dact_swiglu, dp_tiles
from moegraph_kernels.fc1_swiglu import fc1_swiglu
from moegraph_kernels.slot_gemm import slot_gemm

VARIANTS = {  # name: GemmConfig fields
    "tma": dict(tma=True),
    "persistent": dict(persistent=True),
    "persistent+noflat": dict(persistent=True, flatten=False),
    "tma+persistent": dict(tma=True, persistent=True),
    "tma+persistent+ws": dict(tma=True, persistent=True, warp_specialize=True),
}
CASES = [  # (routing, T, k, E, H, F): fp32 rows are 16-byte aligned when H, F % 4 == 0
    ("uniform", 48, 2, 8, 33, 19),  # odd sizes: TMA cannot describe them, pointer fallback
    ("zipf", 64, 4, 7, 36, 20),  # TMA fc1 / fc2 with ragged K and N tiles; dact / dx fall back
    ("one_expert", 40, 1, 5, 64, 64),  # every token to one expert; TMA on all four kernels
    ("sparse_experts", 32, 2, 9, 32, 48),  # empty experts; F spans two column tiles
    ("uniform", 1, 2, 5, 32, 32),  # one token
    ("uniform", 12, 5, 5, 20, 16),  # k == E
]
KERNELS = ("fc1", "fc2", "dact", "dx")
TRANSPOSED_TMA_TILE = ("fc1", "fc2")  # w [E, N, K]: the TMA tile is [BN, BK], transposed


def _cfg(block_m=16, **variant):
    return gc.GemmConfig(block_m, 32, 32, 4, 4, 1, **variant)


@functools.lru_cache(maxsize=None)
def _problem(case, capacity_factor, route_block=16):
    kind, T, k, E, H, F = case
    x, ids, w, w_gate_up, w_down, dout = moe_inputs(kind, T, k, E, H, F, seed=T + E)
    routes = build_routes(ids, w, E, route_block, capacity_factor)
    return x, w.reshape(-1).contiguous(), w_gate_up, w_down, dout, routes


def _nan(*shape):
    return torch.full(shape, float("nan"))


def _run_kernels(case, capacity_factor, cfg, inputs=None, route_block=16):
    """Every slot GEMM under cfg; fc2 / dact / dx read `inputs` (the default path's Y1, A, dY1)
    when given, so each kernel is compared on identical inputs. Returns {kernel: [outputs]}."""
    x, w_N, w_gate_up, w_down, dout, routes = _problem(case, capacity_factor, route_block)
    S, F, H = routes.num_slots, w_down.shape[2], w_down.shape[1]
    y1, act = _nan(S, 2 * F), _nan(S, F)
    fc1_swiglu(x, w_gate_up, w_N, routes, y1, act, cfg)
    y1_in, act_in, dy1_in = inputs or (y1, act, None)
    y2 = slot_gemm(act_in, w_down, routes, _nan(S, H), w_nk=True, cfg=cfg)
    dy1, act2, dp = _nan(S, 2 * F), _nan(S, F), _nan(S, dp_tiles(F, cfg))
    dact_swiglu(dout, w_down, y1_in, w_N, routes, dy1, act2, dp, cfg)
    dx = slot_gemm(dy1 if dy1_in is None else dy1_in, w_gate_up, routes, _nan(S, H),
                   w_nk=False, cfg=cfg)
    return {"fc1": [y1, act], "fc2": [y2], "dact": [dy1, act2, dp], "dx": [dx]}


@functools.lru_cache(maxsize=None)
def _default(case, capacity_factor, route_block=16):
    return _run_kernels(case, capacity_factor, _cfg(route_block), route_block=route_block)


def _live_rows(routes):
    block_live = routes.block_expert >= 0
    return block_live.repeat_interleave(routes.block_m)


def _check_against_default(case, capacity_factor, cfg, route_block=16):
    want = _default(case, capacity_factor, route_block)
    inputs = (want["fc1"][0], want["fc1"][1], want["dact"][0])
    got = _run_kernels(case, capacity_factor, cfg, inputs, route_block)
    plans = dict(gl.LAST_PLAN)
    live = _live_rows(_problem(case, capacity_factor, route_block)[-1])
    for kernel in KERNELS:
        if kernel == "dact" and plans[kernel].paired:  # twice the dp_part columns
            _check_paired_dact(got[kernel], want[kernel], live, lambda g, w, what:
                               torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6,
                                                          msg=what))
            continue
        for i, (g, w) in enumerate(zip(got[kernel], want[kernel])):
            what = f"{kernel} output {i} ({cfg.variant}, plan {plans[kernel]})"
            assert torch.isfinite(g[live]).all(), f"{what}: a live row is not finite"
            assert torch.isnan(g[~live]).all(), f"{what}: a dead block's row was written"
            if (plans[kernel].tma and kernel in TRANSPOSED_TMA_TILE) or plans[kernel].tail:
                torch.testing.assert_close(g[live], w[live], rtol=1e-6, atol=1e-6, msg=what)
            else:
                assert torch.equal(g[live], w[live]), f"{what}: differs from the default"
    return plans


def test_gemm_config_positional_construction_keeps_the_default_path():
    cfg = gc.GemmConfig(128, 128, 64, 8, 8, 3)
    assert (cfg.tma, cfg.persistent, cfg.warp_specialize, cfg.flatten) == (False, False, False,
                                                                           True)
    assert cfg.variant == "base" and tuple(cfg)[:6] == (128, 128, 64, 8, 8, 3)
    assert cfg._replace(tma=True, persistent=True).variant == "tma+persistent"
    assert cfg._replace(persistent=True, flatten=False).variant == "persistent+noflat"
    for name in [*VARIANTS, "base"]:
        assert cfg.with_variant(name).variant == name
        assert cfg.with_variant(name) == cfg._replace(**VARIANTS.get(name, {}))
    with pytest.raises(ValueError, match="unknown variant part 'tmaa'"):
        cfg.with_variant("tmaa+persistent")
    # a register cap: named rN, a launch keyword only when set
    capped = cfg.with_variant("tma+r128")
    assert capped.maxnreg == 128 and capped.variant == "tma+r128"
    assert capped.launch_options() == {"num_warps": 8, "num_stages": 3, "maxnreg": 128,
                                       "enable_fp_fusion": True}
    assert cfg.launch_options() == {"num_warps": 8, "num_stages": 3, "enable_fp_fusion": True}
    with pytest.raises(ValueError, match="one rN"):
        cfg.with_variant("r128+r96")
    # the product's choice (moe/experts.tile_configs), measured on the H200
    big, small = ("tma+persistent+pair", "tma+pair") if gc.FC1_PAIRED else ("tma", "tma")
    big = _fc1_ws(big)
    # dW: the slot-order side by TMA; the long loops persistent with the tile stored by TMA,
    # warp-specialized where the GPU allows (wgrad.WARP_SPECIALIZED)
    long_dw = "tma+persistent+ws+store" if wg.WARP_SPECIALIZED else "tma+persistent+store"
    # FC2 and dX at 128-row blocks: the Gluon kernel where the GPU allows (gc.SLOT_GEMM_WS)
    slot = "tma+persistent+ws" if gc.SLOT_GEMM_WS else "tma+persistent"
    for routes, variants, dw in ((8192 * 8, (big, slot, "pair", slot), long_dw),
                                 (1024 * 8, (small, "base", "base", "tma+persistent"), "tma")):
        chosen = tile_configs(routes, 128, 2048, 768, torch.device("cuda"))
        assert tuple(c.variant for c in chosen[1:5]) == variants
        assert all(c.variant == dw for c in chosen[5:]), [c.variant for c in chosen[5:]]


def _fc1_ws(variant: str) -> str:
    """FC1's variant at 128-row blocks, with the Gluon kernel asked for (gc.FC1_WS)."""
    return gc.GemmConfig(128, 128, 64, 4, 8, 4).with_variant(variant)._replace(
        warp_specialize=gc.FC1_WS).variant


@pytest.mark.parametrize("paired", [False, True])
def test_fc1_pairing_follows_its_switch(paired, monkeypatch):
    """MOEGRAPH_FC1_PAIRED (read into gc.FC1_PAIRED) picks the paired FC1; nothing else moves."""
    monkeypatch.setattr(gc, "FC1_PAIRED", paired)
    chosen = tile_configs(8192 * 8, 128, 2048, 768, torch.device("cuda"))
    assert chosen.fc1.variant == _fc1_ws("tma+persistent+pair" if paired else "tma")
    assert chosen.dact.paired and not any(c.paired for c in (chosen[2], *chosen[4:]))
    small = tile_configs(1024 * 8, 128, 2048, 768, torch.device("cuda"))  # 64-row blocks
    assert small.fc1.variant == ("tma+pair" if paired else "tma")


@pytest.mark.parametrize("paired", [False, True])
def test_dact_pairing_follows_its_switch(paired, monkeypatch):
    """MOEGRAPH_DACT_PAIRED (gc.DACT_PAIRED): dA's paired 128 x 256 tile at 3 stages at
    128-row blocks (the H200's measured choice), the 128 x 128 tile at 4 otherwise."""
    monkeypatch.setattr(gc, "DACT_PAIRED", paired)
    chosen = tile_configs(8192 * 8, 128, 2048, 768, torch.device("cuda")).dact
    assert (chosen.paired, chosen.num_stages) == ((True, 3) if paired else (False, 4))
    assert tuple(chosen)[:5] == (128, 128, 64, 8, 8)
    assert not tile_configs(1024 * 8, 128, 2048, 768, torch.device("cuda")).dact.paired


def test_fc1_default_tiles_by_slot_block():
    """The H200's measured choices (benchmarks/tile_sweep.py) at 128-row blocks: FC1 a K tile
    of 64, FC2 four stages."""
    cuda = torch.device("cuda")
    assert tuple(gc.fc1_config(768, 128, cuda)) == (128, 128, 64, 4, 8, 4, False, False, True,
                                                    False, False, False, None, False, True)
    assert tuple(gc.fc1_config(768, 64, cuda))[:6] == (64, 128, 32, 8, 4, 5)
    assert gc.fc1_config(1408, 128, cuda).block_n == 128  # 1408 = 11 x 128
    assert tuple(gc.fc2_config(2048, 128, cuda))[:6] == (128, 256, 64, 8, 8, 4)
    assert gc.fc2_config(2048, 64, cuda) == gc.slot_gemm_config(2048, 64, cuda)
    assert tuple(gc.slot_gemm_config(2048, 128, cuda))[:6] == (128, 256, 64, 8, 8, 3)  # dX


def test_fc1_tile_override_applies_only_where_its_block_fits(monkeypatch):
    """MOEGRAPH_FC1_TILE (benchmarks/tile_sweep.py's winner) replaces the FC1 tile at slot
    blocks of at least its block_m, keeps the default below, and never touches the CPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    default64, default128 = gc.fc1_config(768, 64, cuda), gc.fc1_config(768, 128, cuda)
    tile = gc.GemmConfig(128, 128, 32, 16, 8, 5)
    monkeypatch.setattr(gc, "FC1_TILE_OVERRIDE", tile)
    assert gc.fc1_config(768, 128, cuda) == tile != default128
    assert gc.fc1_config(768, 64, cuda) == default64
    assert gc.fc1_config(768, 128, cpu) == gc.GemmConfig(128, 32, 32, 4, 4, 1)
    chosen = tile_configs(8192 * 8, 128, 2048, 768, cuda)
    assert chosen.fc1 == tile.with_variant(_fc1_ws("tma+persistent+pair" if gc.FC1_PAIRED
                                                   else "tma"))
    fc2 = gc.GemmConfig(128, 128, 64, 8, 8, 4)
    monkeypatch.setattr(gc, "FC2_TILE_OVERRIDE", fc2)
    chosen = tile_configs(8192 * 8, 128, 2048, 768, cuda)
    slot = "tma+persistent+ws" if gc.SLOT_GEMM_WS else "tma+persistent"
    assert chosen.fc2 == fc2.with_variant(slot)
    # dX keeps its own tile (TMA + persistent, 4 stages at 128-row blocks)
    assert chosen.dx == gc.slot_gemm_config(2048, 128, cuda).with_variant(slot)._replace(
        num_stages=4)
    assert tile_configs(1024 * 8, 128, 2048, 768, cuda).fc2 == gc.GemmConfig(64, 128, 64, 8, 4,
                                                                             4)


# Two variants differ from another only in what the interpreter does not run: `noflat` drops
# tl.range's flatten hint (the interpreter ignores its hints) and `ws` needs 128-row tiles
# (these are 16). Their kernels run the code of persistent / tma+persistent, which meets
# every case; one case each checks the plan they get and their outputs.
HINT_ONLY = ("persistent+noflat", "tma+persistent+ws")
VARIANT_CASES = [pytest.param(v, c, cf, id=f"{v}-{'-'.join(map(str, c))}-{cf}")
                 for v in VARIANTS for c in CASES for cf in (None, 1.0)
                 if v not in HINT_ONLY or (c == CASES[1] and cf is None)]


@pytest.mark.parametrize("variant,case,capacity_factor", VARIANT_CASES)
def test_variant_matches_default_path(variant, case, capacity_factor):
    plans = _check_against_default(case, capacity_factor, _cfg(**VARIANTS[variant]))
    _, _, _, _, H, F = case
    wants_tma = VARIANTS[variant].get("tma", False)
    for kernel, plan in plans.items():
        assert plan.persistent == VARIANTS[variant].get("persistent", False), (kernel, plan)
        assert plan.flatten == (plan.persistent and VARIANTS[variant].get("flatten", True)), \
            (kernel, plan)
        assert not plan.warp_specialize, (kernel, plan)  # 16-row tiles: the pass needs 128
        assert plan.fallback == ""
    if wants_tma and H % 4 == 0 and F % 4 == 0:  # 16-byte fp32 rows: TMA must engage
        assert plans["fc1"].tma and plans["fc2"].tma, plans
        # Y1 / A through TMA stores only where asked and F fills whole column tiles (BN 32).
        assert plans["fc1"].store_tma == (gc.FC1_TMA_STORE and F % 32 == 0), plans
        # w [E, K, N] descriptors only when K (H for dact, 2F for dx) fills whole BK tiles.
        assert plans["dact"].tma == (H % 32 == 0), plans
        assert plans["dx"].tma == (2 * F % 32 == 0), plans
    if not wants_tma or H % 4 or F % 4:
        assert not any(p.tma for p in plans.values()), plans


@pytest.mark.parametrize("case", [("zipf", 96, 4, 7, 64, 32), ("sparse_experts", 80, 2, 9, 32, 64)],
                         ids=lambda c: "-".join(map(str, c)))
def test_warp_specialized_slot_gemm_and_its_scan_free_block_list(case, monkeypatch):
    """128-row tiles (what the Hopper pass needs) take the warp-specialized loop in slot_gemm,
    whose live-block list is built without tl.cumsum; small list chunks make it span several.
    (Off in the product: it lost the CUDA context on the H200 with Triton 3.6; the code path
    stays tested here, switched on.)"""
    monkeypatch.setattr(gc, "WARP_SPECIALIZE_ENABLED", True)
    monkeypatch.setattr(gc, "LIST_CHUNK", 2)
    monkeypatch.setattr(gc, "LIST_CHUNK_WS", 2)
    plans = _check_against_default(case, None, _cfg(128, tma=True, persistent=True,
                                                     warp_specialize=True), route_block=128)
    assert plans["fc2"].warp_specialize and plans["dx"].warp_specialize, plans
    assert not plans["fc1"].warp_specialize and not plans["dact"].warp_specialize, plans
    assert plans["fc2"].tma and plans["fc2"].persistent, plans


def test_warp_specialization_is_off_by_default():
    plans = _check_against_default(("zipf", 96, 4, 7, 64, 32), None,
                                   _cfg(128, tma=True, persistent=True, warp_specialize=True),
                                   route_block=128)
    assert not any(p.warp_specialize for p in plans.values()), plans
    assert plans["fc2"].tma and plans["fc2"].persistent, plans


TAIL_VARIANTS = ["tail", "tma+tail", "persistent+tail", "tma+persistent+tail"]
TAIL_CASES = [  # 32-row route blocks: tails of 1..16 real rows go to the 16-row launch
    ("uniform", 100, 4, 7, 32, 32),  # 384 routes over 7 experts: a mix of short and long tails
    ("zipf", 80, 4, 9, 36, 20),  # ragged K and N tiles, empty experts
    ("one_expert", 40, 1, 5, 64, 64),  # one expert: 40 routes = 32 + a tail of 8
]


def _tail_rows(routes):
    """Mask of the slots of each expert's last block where that block is at most half real
    (the rows the tail launch owns), and how many experts have a long (> half) last block."""
    counts, starts = routes.expert_counts.long(), routes.expert_starts.long()
    rem = counts % routes.block_m
    short = (rem > 0) & (rem <= routes.block_m // 2)
    mask = torch.zeros(routes.num_slots, dtype=torch.bool)
    for e in torch.nonzero(short).flatten().tolist():
        row0 = starts[e] + counts[e] - rem[e]
        mask[row0:row0 + routes.block_m] = True
    return mask, int((rem > routes.block_m // 2).sum())


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("case", TAIL_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("variant", TAIL_VARIANTS)
def test_split_tail_matches_the_whole_block_tiles(variant, case, capacity_factor):
    """Every kernel with the split tail against the default path at the same 32-row route
    blocks: the same values on every live row (NaN-poisoned outputs: a tail row left unwritten
    or a dead block's row written shows up), and the tail launch really ran."""
    routes = _problem(case, capacity_factor, 32)[-1]
    tail_rows, _ = _tail_rows(routes)
    assert tail_rows.any(), "the case must hold a short tail"
    plans = _check_against_default(case, capacity_factor,
                                   _cfg(32).with_variant(variant), route_block=32)
    for kernel, plan in plans.items():
        assert plan.tail and plan.fallback == "", (kernel, plan)


def test_split_tail_leaves_the_short_tails_to_the_second_launch(monkeypatch):
    """With the tail launch cut to one program (expert 0, column tile 0), the short tails of
    every other expert stay unwritten (NaN) and every other live row is computed: the first
    launch really skips them, so no row is computed twice."""
    case = ("uniform", 100, 4, 7, 32, 32)
    routes = _problem(case, None, 32)[-1]
    tail_rows, long_tails = _tail_rows(routes)
    others = tail_rows.clone()
    others[:int(routes.expert_starts[1])] = False  # expert 0's rows
    assert others.any() and long_tails > 0
    monkeypatch.setattr(gl, "tail_grid", lambda *args: (1,))
    for variant in ("tail", "tma+tail"):  # one program per (expert, column tile)
        got = _run_kernels(case, None, _cfg(32).with_variant(variant), route_block=32)
        live = _live_rows(routes)
        for kernel in KERNELS:
            for out in got[kernel]:
                assert torch.isnan(out[others]).all(), (variant, kernel)
                assert torch.isfinite(out[live & ~tail_rows]).all(), (variant, kernel)


def test_split_tail_needs_the_tile_to_be_the_route_block():
    routes = _problem(("uniform", 100, 4, 7, 32, 32), None, 32)[-1]
    assert gc.splits_tail(routes, _cfg(32, split_tail=True))
    assert not gc.splits_tail(routes, _cfg(32))
    assert not gc.splits_tail(routes, _cfg(16, split_tail=True))  # 16-row tiles in 32 blocks
    assert not gc.splits_tail(_problem(("uniform", 100, 4, 7, 32, 32), None)[-1],
                              _cfg(16, split_tail=True))  # halves under 16 rows
    half = gc.tail_config(gc.GemmConfig(128, 256, 64, 8, 8, 4, tma=True, persistent=True,
                                        split_tail=True))
    assert half == gc.GemmConfig(64, 256, 64, 8, 8, 4, tma=True, persistent=True)
    assert gc.tail_config(gc.GemmConfig(128, 128, 64, 4, 8, 4, split_tail=True)).num_warps == 4


@pytest.mark.parametrize("keep_act", [False, True])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("pair", ["", "+pair"])
def test_split_tail_end_to_end_matches_reference(capacity_factor, pair, keep_act):
    """The split tail, also under the paired FC1 (its tail launch reuses the pair box), and
    with FC1's activation kept (dA's tail then writes no A)."""
    case = ("zipf", 96, 4, 7, 32, 32)
    tail = _cfg(32).with_variant("tma+persistent+tail" + pair)
    _end_to_end_matches_reference(case, capacity_factor, lambda base: base._replace(
        route_block=32, fc1=tail, fc2=tail, dact=tail, dx=tail), keep_act)
    assert all(gl.LAST_PLAN[kernel].tail for kernel in KERNELS)
    assert gl.LAST_PLAN["fc1"].paired == bool(pair)


@pytest.mark.parametrize("store_tma", [False, True])
@pytest.mark.parametrize("case", [("one_expert", 40, 1, 5, 64, 64), ("zipf", 64, 4, 7, 36, 20)],
                         ids=lambda c: "-".join(map(str, c)))
def test_fc1_tma_stores_match_pointer_stores(store_tma, case, monkeypatch):
    """MOEGRAPH_FC1_TMA_STORE: Y1 and A through TMA store descriptors where F fills whole
    column tiles (F = 64 here; F = 20 keeps the pointer stores), equal to the default path."""
    monkeypatch.setattr(gc, "FC1_TMA_STORE", store_tma)
    plans = _check_against_default(case, None, _cfg(tma=True))
    assert plans["fc1"].tma and plans["fc1"].store_tma == (store_tma and case[-1] % 32 == 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("variant", ["tma+pair", "tma+persistent+pair"])
def test_fc1_paired_gate_up_box_matches_the_default(case, capacity_factor, variant):
    """The paired FC1: gate and up tiles as one [2, BN, BK] box of w_gate_up seen as
    [2E, F, H], one [BM, 2 BN] dot, the accumulator split in the epilogue. F = 19 / 20 / 48
    leave ragged column tiles (the box reads zeros past F, never the up rows); odd sizes fall
    back to the pointer path."""
    plans = _check_against_default(case, capacity_factor, _cfg().with_variant(variant))
    _, _, _, H, F = case[1:]
    assert plans["fc1"].paired == (H % 4 == 0 and F % 4 == 0), plans["fc1"]
    assert plans["fc1"].paired == plans["fc1"].tma


def test_paired_descriptor_refusals():
    """No box over a layout it cannot describe: 2 BN > 256 (one dot), non-contiguous experts."""
    w = torch.zeros(3, 2 * 64, 32)
    assert tma.gate_up_pair_desc(w, 32, 32) is not None
    assert tma.gate_up_pair_desc(w, 256, 32) is None
    assert tma.gate_up_pair_desc(w[:, :96], 32, 32) is None  # rows of an expert not 2F apart
    assert tma.gate_up_pair_desc(w.transpose(1, 2), 32, 32) is None


def test_persistent_block_list_spans_several_chunks(monkeypatch):
    monkeypatch.setattr(gc, "LIST_CHUNK", 4)  # 23 M blocks here: six chunks
    plans = _check_against_default(("zipf", 64, 4, 7, 36, 20), 0.5, _cfg(tma=True,
                                                                         persistent=True))
    assert all(p.persistent for p in plans.values())


def test_missing_features_fall_back_to_the_pointer_path(monkeypatch):
    """Older Triton: no host tensor descriptors, a tl.range without flatten."""
    monkeypatch.setattr(tma, "TensorDescriptor", None)
    monkeypatch.setattr(tma, "range_supports", lambda keyword: False)
    plans = _check_against_default(("one_expert", 40, 1, 5, 64, 64), None,
                                   _cfg(tma=True, persistent=True, warp_specialize=True))
    assert not any(p.tma or p.persistent or p.warp_specialize for p in plans.values()), plans


def test_a_variant_that_fails_on_the_gpu_is_replaced_by_the_pointer_path(monkeypatch):
    monkeypatch.setattr(gl, "_FAILED_VARIANTS", {})
    calls = []

    def launch(cfg):
        calls.append(cfg.variant)
        gl.LAST_PLAN["fc2"] = gl.Plan(cfg.tma, cfg.persistent, cfg.flatten, False, 1)
        if cfg.tma:
            raise RuntimeError("PassManager::run failed\nlong reproducer")
        return "ran"

    cfg = _cfg(tma=True)
    cuda = torch.device("cuda")
    with pytest.warns(RuntimeWarning, match="tma variant"):
        assert gl.with_fallback("fc2", cfg, cuda, (1,), launch) == "ran"
    assert calls == ["tma", "base"]
    assert gl.LAST_PLAN["fc2"].fallback == "RuntimeError: PassManager::run failed"
    # Remembered: the broken variant is not compiled again.
    assert gl.with_fallback("fc2", cfg, cuda, (1,), launch) == "ran"
    assert calls == ["tma", "base", "base"]
    monkeypatch.setattr(gl, "FALLBACK_ON_ERROR", False)
    with pytest.raises(RuntimeError, match="PassManager"):
        gl.with_fallback("fc2", cfg, cuda, (2,), launch)


def test_dact_fallback_keeps_its_paired_tile(monkeypatch):
    """dp_part's columns follow dact's paired tile (quarters): the pointer path that replaces a
    failed dact variant keeps `paired`, so it writes every column the buffer was sized for."""
    monkeypatch.setattr(gl, "_FAILED_VARIANTS", {})
    ran = []

    def launch(cfg):
        ran.append(cfg)
        for name in ("dact", "fc1"):
            gl.LAST_PLAN[name] = gl.Plan(cfg.tma, cfg.persistent, cfg.flatten, False, 1)
        if cfg.tma:
            raise RuntimeError("a variant that cannot compile")
        return "ran"

    cfg = _cfg(tma=True, persistent=True, paired=True)
    with pytest.warns(RuntimeWarning, match="variant"):
        gl.with_fallback("dact", cfg, torch.device("cuda"), (1,), launch, keep=("paired",))
    assert ran[-1] == cfg._replace(tma=False, persistent=False) and ran[-1].paired
    # other kernels' pointer path drops it (FC1's paired box needs TMA)
    with pytest.warns(RuntimeWarning, match="variant"):
        gl.with_fallback("fc1", cfg, torch.device("cuda"), (1,), launch)
    assert not ran[-1].paired and not ran[-1].tma


def test_a_variant_over_shared_memory_loses_stages_before_it_falls_back(monkeypatch):
    """fp32 operands need twice a stage's bytes: on the H200 the 64-row dX tile's TMA +
    persistent variant asked 245808 B of 232448 at 3 stages. It keeps its variant at fewer
    stages (the same K tiles in the same order: the same result), as the pointer path does."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(gl, "_FAILED_VARIANTS", {})
    monkeypatch.setattr(gl, "_FITTED_STAGES", {})
    calls = []

    def launch(cfg):
        calls.append((cfg.variant, cfg.num_stages))
        if cfg.num_stages > 2:
            raise OutOfResources(245808, 232448, "shared memory")
        return "ran"

    cfg = _cfg(tma=True, persistent=True)._replace(num_stages=3)
    cuda = torch.device("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        assert gl.with_fallback("dx", cfg, cuda, (torch.float32,), launch) == "ran"
    assert calls == [("tma+persistent", 3), ("tma+persistent", 2)]
    assert gl.with_fallback("dx", cfg, cuda, (torch.float32,), launch) == "ran"
    assert calls[-1] == ("tma+persistent", 2)  # the fitted count is remembered


def test_tma_checks_reject_what_a_descriptor_cannot_describe():
    w = torch.zeros(4, 8, 36)
    assert tma.expert_rows(w).shape == (32, 36)
    assert tma.matrix_fits(tma.expert_rows(w), (32, 32))
    assert not tma.matrix_fits(torch.zeros(8, 33), (8, 32))  # 132-byte rows
    assert not tma.matrix_fits(torch.zeros(8, 32)[:, 1:], (8, 16))  # base off 16 bytes
    assert not tma.matrix_fits(torch.zeros(8, 32), (8, 24))  # block not a power of two
    assert not tma.matrix_fits(torch.zeros(8, 32), (8, 2))  # inner block under 16 bytes
    assert tma.expert_rows(torch.zeros(4, 36, 8).transpose(1, 2)) is None  # not row-major


@pytest.mark.parametrize("variant", ["tma+persistent", "persistent"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
@pytest.mark.parametrize("kind,T,k,E,H,F", [("zipf", 64, 4, 7, 36, 20),
                                            ("one_expert", 40, 1, 5, 64, 64),
                                            ("uniform", 48, 2, 8, 33, 19)])
def test_variant_end_to_end_matches_reference(kind, T, k, E, H, F, capacity_factor, variant):
    fields = VARIANTS[variant]
    _end_to_end_matches_reference(
        (kind, T, k, E, H, F), capacity_factor, lambda base: base._replace(
            fc1=base.fc1._replace(**fields), fc2=base.fc2._replace(**fields),
            dact=base.dact._replace(**fields), dx=base.dx._replace(**fields)))


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
@pytest.mark.parametrize("kind,T,k,E,H,F", [("zipf", 64, 4, 7, 36, 64),
                                            ("sparse_experts", 32, 2, 9, 32, 128),
                                            ("uniform", 12, 5, 5, 20, 64)])
def test_paired_dact_end_to_end_matches_reference(kind, T, k, E, H, F, capacity_factor):
    """The expert path with dA's paired tile (the product's choice at 128-row blocks on a
    GPU): output and every gradient, the route weights' through dp_part's quarter columns."""
    _end_to_end_matches_reference(
        (kind, T, k, E, H, F), capacity_factor,
        lambda base: base._replace(dact=base.dact.with_variant("pair")))
    assert gl.LAST_PLAN["dact"].paired


def _end_to_end_matches_reference(case, capacity_factor, configure, keep_act=False):
    """permute_free_moe under configure(the CPU's tile_configs), poisoned scratch, against
    reference_moe: output and every gradient (`keep_act`: FC1's activation kept)."""
    kind, T, k, E, H, F = case
    x, ids, w, w_gate_up, w_down, dout = moe_inputs(kind, T, k, E, H, F, seed=T + E)
    configs = configure(tile_configs(T * k, E, H, F, torch.device("cpu")))

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up, w_down)]
        y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        return [y.detach(), *torch.autograd.grad(y, leaves, dout)]

    with poisoned_scratch():
        got = run(lambda *a: permute_free_moe_with_drops(*a, capacity_factor, configs,
                                                         keep_act=keep_act)[0])
    want = run(lambda *a: reference_moe(*a, capacity_factor))
    for name, g, r in zip(["y", "dx", "dtopk_weights", "dw_gate_up", "dw_down"], got, want):
        assert torch.isfinite(g).all(), name
        scale = max(1.0, r.abs().max().item())
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# GPU: each variant against the default path in bf16, bitwise (same tile shape, same K order).

GPU_SHAPES = [  # (routing, T, k, E, H, F)
    ("zipf", 512, 4, 16, 512, 256),
    ("uniform", 1024, 8, 128, 2048, 768),  # the Qwen3 expert shape at T=1024
    ("sparse_experts", 2048, 8, 33, 1024, 384),  # empty experts, 128-row route blocks
]
GPU_VARIANTS = dict(VARIANTS, **{"tma+persistent+ws": dict(tma=True, persistent=True,
                                                           warp_specialize=True,
                                                           num_warps=4),
                                 "tail": dict(split_tail=True),
                                 "tma+tail": dict(tma=True, split_tail=True),
                                 "tma+persistent+tail": dict(tma=True, persistent=True,
                                                             split_tail=True),
                                 # fc1 / dact with Triton's own exp and division
                                 # (gated_act.py): bitwise the FAST default on these inputs
                                 "exact": dict(fast_act=False)})


@functools.lru_cache(maxsize=None)
def _gpu_problem(case):
    kind, T, k, E, H, F = case
    x, ids, w, w_gate_up, w_down, dout = [t.cuda() for t in moe_inputs(kind, T, k, E, H, F, 1)]
    bf = torch.bfloat16
    block = gc.route_block_m(T * k, E, x.device)
    routes = build_routes(ids, w, E, block, None)
    return (x.to(bf), w.reshape(-1).to(bf), w_gate_up.to(bf), w_down.to(bf), dout.to(bf),
            routes)


def _gpu_kernel(kernel, case, cfg, inputs):
    x, w_N, w_gate_up, w_down, dout, routes = _gpu_problem(case)
    S, F, H = routes.num_slots, w_down.shape[2], w_down.shape[1]

    def nan(*shape, dt=torch.bfloat16):
        return torch.full(shape, float("nan"), dtype=dt, device="cuda")

    if kernel == "fc1":
        return list(fc1_swiglu(x, w_gate_up, w_N, routes, nan(S, 2 * F), nan(S, F), cfg))
    if kernel == "fc2":
        return [slot_gemm(inputs["act"], w_down, routes, nan(S, H), True, cfg)]
    if kernel == "dact":
        dp = nan(S, dp_tiles(F, cfg), dt=torch.float32)
        return list(dact_swiglu(dout, w_down, inputs["y1"], w_N, routes, nan(S, 2 * F),
                                nan(S, F), dp, cfg))
    return [slot_gemm(inputs["dy1"], w_gate_up, routes, nan(S, H), False, cfg)]


def _gpu_default_config(kernel, case):
    _, T, k, E, H, F = case
    block = gc.route_block_m(T * k, E, torch.device("cuda"))
    dev = torch.device("cuda")
    return {"fc1": gc.fc1_config(F, block, dev), "fc2": gc.slot_gemm_config(H, block, dev),
            "dact": gc.dact_config(F, block, dev), "dx": gc.slot_gemm_config(H, block, dev)}[kernel]


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_cuda_variant_is_bitwise_equal_to_default(variant, case, kernel):
    base_cfg = _gpu_default_config(kernel, case)
    fields = dict(GPU_VARIANTS[variant])
    if "num_warps" in fields:  # the warp-specialized tile: 4 warps -> 1 producer + 2 consumers
        if kernel not in ("fc2", "dx") or base_cfg.block_m < 128:
            pytest.skip("warp specialization applies to slot_gemm with 128-row tiles only")
        base_cfg = base_cfg._replace(num_warps=fields.pop("num_warps"))
    y1, act = _gpu_kernel("fc1", case, base_cfg if kernel == "fc1" else
                          _gpu_default_config("fc1", case), None)
    dact_cfg = _gpu_default_config("dact", case)
    dy1 = _gpu_kernel("dact", case, dact_cfg, {"y1": y1})[0]
    inputs = {"y1": y1, "act": act, "dy1": dy1}
    want = _gpu_kernel(kernel, case, base_cfg, inputs)
    got = _gpu_kernel(kernel, case, base_cfg._replace(**fields), inputs)
    plan = gl.LAST_PLAN[kernel]
    torch.cuda.synchronize()
    live = _live_rows(_gpu_problem(case)[-1])
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g[live]).all(), (i, plan)
        assert torch.isnan(g[~live]).all(), (i, plan)
        assert torch.equal(g[live], w[live]), (
            f"{kernel} output {i} under {variant} ({plan}): max |diff| "
            f"{(g[live].float() - w[live].float()).abs().max().item():.3e}")
    if plan.fallback:
        pytest.xfail(f"{variant} fell back to the pointer path: {plan.fallback}")
    on_hopper = torch.cuda.get_device_capability()[0] >= 9
    assert plan.tma == (fields.get("tma", False) and on_hopper), plan
    assert plan.persistent == fields.get("persistent", False), plan
    assert plan.tail == fields.get("split_tail", False), plan


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_fc1_tma_stores_are_bitwise_equal_to_pointer_stores(case, monkeypatch):
    cfg = _gpu_default_config("fc1", case)._replace(tma=True)
    monkeypatch.setattr(gc, "FC1_TMA_STORE", False)
    want = _gpu_kernel("fc1", case, cfg, None)
    monkeypatch.setattr(gc, "FC1_TMA_STORE", True)
    got = _gpu_kernel("fc1", case, cfg, None)
    plan = gl.LAST_PLAN["fc1"]
    torch.cuda.synchronize()
    live = _live_rows(_gpu_problem(case)[-1])
    assert plan.store_tma, plan
    for g, w in zip(got, want):
        assert torch.isnan(g[~live]).all() and torch.equal(g[live], w[live]), plan


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("variant", ["tma+pair", "tma+persistent+pair", "96KB:tma+pair"])
def test_cuda_fc1_paired_box_is_bitwise_equal(case, variant, monkeypatch):
    """One [BM, 2 BN] dot over the [2, BN, BK] gate/up box sums each element's K tiles in the
    same order as the two dots: bitwise equal to the unpaired TMA path (no fallback taken).
    `96KB:` runs the 128 x (2 x 64) x 64 tile of 3 stages (two programs per SM)."""
    monkeypatch.setattr(gl, "FALLBACK_ON_ERROR", False)
    base = _gpu_default_config("fc1", case)._replace(paired=False)
    if variant.startswith("96KB:"):
        variant = variant[5:]
        base = gc.GemmConfig(base.block_m, 64, 64, 8, 8, 3)
    want = _gpu_kernel("fc1", case, base.with_variant("tma"), None)
    got = _gpu_kernel("fc1", case, base.with_variant(variant), None)
    plan = gl.LAST_PLAN["fc1"]
    torch.cuda.synchronize()
    live = _live_rows(_gpu_problem(case)[-1])
    assert plan.paired and not plan.fallback, plan
    for g, w in zip(got, want):
        assert torch.isnan(g[~live]).all() and torch.equal(g[live], w[live]), plan


@pytest.mark.cuda
def test_cuda_persistent_tma_slot_gemm_replays_in_a_graph_with_new_routing():
    """The live-block list is rebuilt on the device at every replay: new routing, same graph."""
    case = ("zipf", 512, 4, 16, 512, 256)
    x, w_N, w_gate_up, w_down, dout, routes = _gpu_problem(case)
    cfg = _gpu_default_config("fc2", case)._replace(tma=True, persistent=True)
    act = torch.randn(routes.num_slots, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(routes.num_slots, 512, device="cuda", dtype=torch.bfloat16)
    static = [t.clone() for t in routes[:-1]]
    static_routes = type(routes)(*static, block_m=routes.block_m)
    slot_gemm(act, w_down, static_routes, out, True, cfg)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slot_gemm(act, w_down, static_routes, out, True, cfg)
    _, ids2, w2, *_ = moe_inputs("sparse_experts", 512, 4, 16, 512, 256, seed=7)
    routes2 = build_routes(ids2.cuda(), w2.cuda(), 16, routes.block_m, None)
    for dst, src in zip(static, routes2[:-1]):
        dst.copy_(src)
    graph.replay()
    want = torch.zeros_like(out)
    slot_gemm(act, w_down, routes2, want, True, _gpu_default_config("fc2", case))
    torch.cuda.synchronize()
    live = _live_rows(routes2)
    assert torch.equal(out[live], want[live])


DACT_PAIR_CASES = [  # F a multiple of 2 BN (64 on the CPU tile)
    ("uniform", 48, 2, 8, 33, 64),  # odd H: ragged K tiles
    ("sparse_experts", 32, 2, 9, 32, 128),  # empty experts; two paired column tiles
    ("uniform", 1, 2, 5, 32, 64),  # one token
    ("uniform", 12, 5, 5, 20, 64),  # k == E
    ("one_expert", 40, 1, 5, 64, 64),  # every token to one expert
]


@pytest.mark.parametrize("variant", ["pair", "persistent+pair"])
@pytest.mark.parametrize("case", DACT_PAIR_CASES, ids=lambda c: "-".join(map(str, c)))
def test_dact_paired_halves_match_the_bn_tile(case, variant):
    """dact's [BM, 2 BN] tile with its epilogue in BN / 2 quarters against the BN-wide tile,
    on the same inputs: dY1 and A, and dp_part's quarter columns, pairwise summed, against the
    BN tile's columns; dead blocks' rows left NaN. The interpreter's numpy dot may sum a wider
    tile in another order, so the CPU compares to 1e-6; the CUDA test below asks for bitwise
    dY1 and A."""
    want = _default(case, None)
    inputs = (want["fc1"][0], want["fc1"][1], want["dact"][0])
    got = _run_kernels(case, None, _cfg().with_variant(variant), inputs)
    plan = gl.LAST_PLAN["dact"]
    assert plan.paired and plan.persistent == ("persistent" in variant), plan
    live = _live_rows(_problem(case, None)[-1])
    _check_paired_dact(got["dact"], want["dact"], live,
                       lambda g, w, what: torch.testing.assert_close(
                           g, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}"))


@pytest.mark.parametrize("variant", ["pair", "persistent+pair"])
def test_dact_paired_clamped_matches_the_bn_tile(variant):
    """The same with GPT-OSS's clamped SwiGLU backward in the quarters' epilogue (a limit low
    enough that both clamps bind on some elements)."""
    case = ("sparse_experts", 32, 2, 9, 32, 128)
    x, w_N, w_gate_up, w_down, dout, routes = _problem(case, None)
    S, F = routes.num_slots, w_down.shape[2]
    y1 = _default(case, None)["fc1"][0]

    def run(cfg):
        outs = (_nan(S, 2 * F), _nan(S, F), _nan(S, dp_tiles(F, cfg)))
        return list(dact_swiglu(dout, w_down, y1, w_N, routes, *outs, cfg,
                                clamp=(1.702, 0.5)))
    want = run(_cfg())
    got = run(_cfg().with_variant(variant))
    assert gl.LAST_PLAN["dact"].paired
    assert (y1[_live_rows(routes)].abs() > 0.5).any()  # the clamps bind somewhere
    _check_paired_dact(got, want, _live_rows(routes), lambda g, w, what:
                       torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=what))


def _check_paired_dact(got, want, live, same):
    """dY1 and A by `same`; dp_part: twice the columns, each pair summing to the BN tile's."""
    for i in range(2):
        assert torch.isnan(got[i][~live]).all(), f"dact output {i}: a dead block's row written"
        same(got[i][live], want[i][live], f"dact output {i}")
    dp, dp_want = got[2][live], want[2][live]
    assert dp.shape[1] == 2 * dp_want.shape[1]
    assert torch.isnan(got[2][~live]).all()
    torch.testing.assert_close(dp.view(dp.shape[0], -1, 2).sum(-1), dp_want, rtol=1e-5,
                               atol=1e-5)


def test_dact_paired_needs_2bn_to_divide_f():
    from moegraph_kernels.dact_swiglu import paired_tile as halves
    cfg = _cfg(paired=True)
    assert halves(64, cfg) and halves(128, cfg)
    assert not halves(96, cfg) and not halves(32, cfg) and not halves(64, _cfg())
    case = ("sparse_experts", 32, 2, 9, 32, 48)  # F = 48: the BN tile runs instead
    _run_kernels(case, None, _cfg(paired=True))
    assert not gl.LAST_PLAN["dact"].paired


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["pair", "tma+pair", "tma+persistent+pair"])
@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_dact_paired_halves_are_bitwise_equal(case, variant, monkeypatch):
    """dact's [BM, 2 BN] tile (128 x 256 at the product's 128 x 128), one dot a K step, its
    epilogue in halves, against the default BN tile under the same variant otherwise."""
    monkeypatch.setattr(gl, "FALLBACK_ON_ERROR", False)
    base = _gpu_default_config("dact", case)._replace(paired=False)
    F = case[-1]
    if F % (2 * base.block_n):
        pytest.skip("2 BN does not divide F")
    y1 = _gpu_kernel("fc1", case, _gpu_default_config("fc1", case), None)[0]
    plain = variant.replace("pair", "").strip("+") or "base"
    want = _gpu_kernel("dact", case, base.with_variant(plain), {"y1": y1})
    got = _gpu_kernel("dact", case, base._replace(num_stages=3).with_variant(variant),
                      {"y1": y1})
    plan = gl.LAST_PLAN["dact"]
    torch.cuda.synchronize()
    live = _live_rows(_gpu_problem(case)[-1])
    assert plan.paired and not plan.fallback, plan

    def same(g, w, what):
        assert torch.equal(g, w), (
            f"{what} under {variant}: max |diff| {(g.float() - w.float()).abs().max().item():.3e}")
    _check_paired_dact(got, want, live, same)
