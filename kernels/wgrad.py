"""Expert-centric weight gradients: one program owns one dW tile, no atomics.

dW[e, m, n] = sum over the real slots s of expert e of L[row_L(s), m] * R[row_R(s), n]

Layout contract (S slots, E experts, see route_align.py):
- L [rows_L, M] and R [rows_R, N], row-major with a contiguous last dimension. Each operand is
  read either in slot order (row = s; an [S, *] slot tensor) or gathered (row =
  slot_token[s]; a [T, *] token tensor) -- `gather_l` / `gather_r`.
- dW [E, M, N] in the output's dtype, fp32 accumulation. The contraction runs over slots
  expert_starts[e] + [0, expert_counts[e]) -- read from the device, so no host sync and no
  padding slot is ever touched (the slot loads past the count are masked to zero).
  An empty expert's tiles get exact zeros.
- Uses: dW_down[e] [H, F] = sum_s dOut[slot_token[s]]^T A[s]  (L = dOut gathered, R = A);
        dW_gate_up[e] [2F, H] = sum_s dY1[s]^T X[slot_token[s]]  (L = dY1, R = X gathered).
- `accumulate`: the tile is added (in fp32, one rounding to the output dtype) to what dW
  holds, instead of overwriting it (gradient accumulation over micro-batches); an empty
  expert's tiles are then left as they were (plus exact zeros).
- The K loop runs over the expert's padded slot range (`PADDED_K`, where BLOCK_K divides the
  route block): its padding slots read zeros from a slot-order operand (every row of a live
  block is written, zeros for padding) and are masked by their sentinel token in a gathered
  one, so no K mask is needed and, with `GemmConfig.tma`, the slot-order operand loads
  through a TMA descriptor (box [BLOCK_K, tile] at (slot, column)). The values the dot sees
  are those of the masked loop, so the result is the same.
- Programs run expert-major; within an expert, tiles are grouped GROUP_M rows at a time so the
  expert's L and R rows are reused from L2. The sum order is fixed: bitwise repeatable.
- Variants that change no value (each tile sums the same terms in the same order):
  `GemmConfig.persistent`, one program an SM walking the tiles in that order (each tile's K
  loop pipelined as before); `GemmConfig.store_tma`, the tile written by a TMA bulk store
  (where M is a multiple of BLOCK_M, dW is 2-byte and the launch does not accumulate);
  `GemmConfig.warp_specialize`, on a Hopper GPU, the warp-specialized Gluon kernel of
  wgrad_ws.py (where `wgrad_ws.fits`: one operand gathered, 2-byte operands, whole tiles, no
  accumulation; the padded loop; it always stores by TMA), whose loads run ahead across
  tiles.

Bias gradients (`expert_bias_grad`), the same ownership and the same slot range:
db[e, n] = sum over the real slots s of expert e of scale(s) * R[row_R(s), n], with scale 1
(db_gate_up: R = dY1 in slot order) or the slot's route weight p (db_down: R = dOut gathered).
One program owns one [BLOCK_N] column tile of one expert, loops over that expert's slots in
order and reduces once at the end: no atomics, bitwise repeatable; padding slots and dead
blocks are never read; an empty expert gets exact zeros; `accumulate` as above. The
reference is autograd through moe/reference.py's bias terms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm_launch as gl
from . import tma
from . import wgrad_ws
from .env import flag_from_env
from .fp_fusion import FUSED
from .gemm_config import GemmConfig, tile_from_env
from .route_align import RouteList
from .slot_schedule import grouped_pid


# MOEGRAPH_WGRAD_SHORT="bm,bn,bk,group,warps,stages" (what benchmarks/wgrad_sweep.py prints),
# read once here, not on every call.
SHORT_OVERRIDE = tile_from_env("MOEGRAPH_WGRAD_SHORT")

# K tiles over an expert's padded slot range (BLOCK_K dividing the route block), so the
# slot-order operand needs no K mask and can load through TMA (GemmConfig.tma); off
# (MOEGRAPH_WGRAD_PADDED=0): the masked K loop over exactly the real slots. Same values
# either way: the padding slots are zeros on one side and masked on the other.
PADDED_K = flag_from_env("MOEGRAPH_WGRAD_PADDED", True)

# (padded, tma) of the latest launch, keyed by gather_l (True: dW_down, False: dW_gate_up),
# for tests and benchmarks; LAST_WGRAD_STORE the same launch's (persistent, TMA store).
LAST_WGRAD_PLAN: dict[bool, tuple[bool, bool]] = {}
LAST_WGRAD_STORE: dict[bool, tuple[bool, bool]] = {}
# Whether the latest launch ran the warp-specialized Gluon kernel (wgrad_ws.py), same keys.
LAST_WGRAD_WS: dict[bool, bool] = {}

# The long-loop tiles' two variants (`wgrad_config`): `GemmConfig.persistent`, one program an
# SM over the tiles (each tile's K loop as before), and `GemmConfig.store_tma`, the tile
# written by a TMA bulk store where it fits (`_out_desc`). Neither changes a value: the same
# terms summed in the same order. MOEGRAPH_WGRAD_PERSISTENT / MOEGRAPH_WGRAD_TMA_STORE = 0 or
# 1 force them off or on (A/B runs); unset, the config's choice.
PERSISTENT = flag_from_env("MOEGRAPH_WGRAD_PERSISTENT", None)
STORE_TMA = flag_from_env("MOEGRAPH_WGRAD_TMA_STORE", None)

# The long-loop tiles ask for the warp-specialized Gluon kernel (`GemmConfig.warp_specialize`,
# kernels/wgrad_ws.py), taken on a Hopper GPU where the launch fits and the Triton kernel
# otherwise; the same sums. H200 (benchmarks/kernel_sweep.py, Qwen3 shape, uniform routing,
# results/kernel_sweep_wgrad_ws_variants_h200.json), ms against the persistent TMA tile:
# dW_gate_up 1.063 -> 0.858 (T = 8192), 1.877 -> 1.517 (16384), 3.401 -> 2.838 (32768);
# dW_down 0.495 -> 0.413, 0.840 -> 0.777, 1.535 -> 1.442; the H100 likewise
# (kernel_sweep_ws_h100.json). MOEGRAPH_WGRAD_WS=0 keeps the Triton kernel.
WARP_SPECIALIZED = flag_from_env("MOEGRAPH_WGRAD_WS", True)


def wgrad_config(n: int, device: torch.device, routes_per_expert: float | None = None,
                 slot_order_l: bool = False) -> GemmConfig:
    """The dW tile for an N-wide weight. `routes_per_expert` (T * k / E, known on the host)
    says how long the K loops are: at most 128 slots an expert is the short-loop regime,
    with its own tile, which `MOEGRAPH_WGRAD_SHORT` ("bm,bn,bk,group,warps,stages", what
    benchmarks/kernel_sweep.py names) overrides. `slot_order_l`: L is the slot-order operand
    (dW_gate_up: L = dY1) rather than R (dW_down: R = A); that side gets the tile's 256."""
    if device.type != "cuda":
        return GemmConfig(32, 32, 16, 4, 4, 1)
    if routes_per_expert is not None and routes_per_expert <= 128:
        # Two K iterations an expert at T = 1024: a deep pipeline only costs shared memory
        # and occupancy. H200 sweeps: 0.645 ms for both dW kernels of a Qwen3-30B layer at
        # a 5-stage tile, 0.560 ms at 128 x 128 x 32, 4 warps, 2 stages
        # (results/wgrad_sweep.json); then a K tile of 64 and the slot-order operand by TMA,
        # with the token ids a step ahead: 0.184 / 0.428 -> 0.178 / 0.346 ms (dW_down /
        # dW_gate_up, results/kernel_sweep_ends_ahead.json, T = 1024).
        return SHORT_OVERRIDE or GemmConfig(128, 128, 64, 8, 4, 2, tma=True)
    if n % 128 == 0 or n > 256:
        # 256 x 128 (128 x 256 for dW_down) x 64, 3 stages (144 KB), the slot-order operand
        # by TMA across the 256, the token ids a step ahead: H200 sweep
        # (benchmarks/kernel_sweep.py, Qwen3 shape, results/kernel_sweep_8192_ahead.json and
        # kernel_sweep_ends_ahead.json) dW_gate_up 0.997 / 1.044 / 3.288 ms (T = 8192
        # uniform, skewed; 32768), dW_down 0.500 / 0.507 / 1.554 ms, against 1.243 / 1.240
        # / 4.316 and 0.606 / 0.616 / 2.136 ms for the masked 128 x 128 x 32 x 5-stage
        # pointer tile of before (its `masked` rows in kernel_sweep_8192.json and
        # kernel_sweep_ends.json). At 128 x 128 x 64, four stages ran slower than three.
        wide = GemmConfig(256, 128, 64, 4, 8, 3, tma=True)
        # Persistent, the tile by a TMA store (benchmarks/kernel_sweep.py on the H200,
        # results/kernel_sweep_wgrad_store.json, uniform / skewed): dW_down 0.497 / 0.538 ->
        # 0.421 / 0.442 ms at T = 8192 and 1.546 / 1.495 -> 1.425 / 1.508 at 32768; dW_gate_up
        # 1.011 / 1.001 -> 0.930 / 0.959 at 8192 with the store, but at 32768 3.264 / 3.270
        # -> 3.142 / 3.207 persistent alone against 3.153 / 3.432 with it: its store is kept
        # to the shorter loops (at most 1024 slots an expert).
        wide = wide._replace(warp_specialize=WARP_SPECIALIZED)
        if slot_order_l:
            store = routes_per_expert is None or routes_per_expert <= 1024
            return _forced(wide._replace(persistent=True, store_tma=store))
        return _forced(wide._replace(block_m=128, block_n=256, persistent=True,
                                     store_tma=True))
    # Narrow weights: 128 x 64 x 32, 5 stages (the sweep of benchmarks/moe_experts.py).
    return GemmConfig(128, 64, 32, 8, 4, 5)


def _forced(cfg: GemmConfig) -> GemmConfig:
    """cfg with MOEGRAPH_WGRAD_PERSISTENT / MOEGRAPH_WGRAD_TMA_STORE applied where set."""
    if PERSISTENT is not None:
        cfg = cfg._replace(persistent=PERSISTENT)
    if STORE_TMA is not None:
        cfg = cfg._replace(store_tma=STORE_TMA)
    return cfg


@triton.jit
def _wgrad_tile(
    pid, l_ptr, r_ptr, l_desc, r_desc, dw_ptr, dw_desc, slot_token_ptr, expert_start_ptr,
    expert_count_ptr, M, N, num_tokens, num_slots, stride_l, stride_r, stride_dwe, stride_dwm,
    GATHER_L: tl.constexpr, GATHER_R: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PADDED: tl.constexpr, L_TMA: tl.constexpr, R_TMA: tl.constexpr,
    OUT_TMA: tl.constexpr,
):
    """dW tile `pid` (expert-major, GROUP_M-grouped within an expert)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.cast(pid, tl.int32)  # a Python int in the interpreter's persistent loop
    expert = pid // (tiles_m * tiles_n)
    pid_m, pid_n = grouped_pid(pid % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
    start = tl.load(expert_start_ptr + expert)
    count = tl.load(expert_count_ptr + expert)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PADDED:
        # The gathered operand's token ids, loaded one K step ahead (loop-carried): the
        # pipeliner then keeps num_stages buffers in flight, where an id load feeding its
        # row load in the same step leaves it about half as many.
        tok_next = tl.load(slot_token_ptr + start + offs_k, mask=start + offs_k < num_slots,
                           other=num_tokens)
    for k0 in range(0, count, BLOCK_K):
        slots = start + k0 + offs_k
        row_l = slots
        row_r = slots
        if PADDED:
            # The K tile stays inside the expert's live blocks (BLOCK_K divides the route
            # block): slots past the count are padding, zeros in a slot-order operand and
            # masked by their sentinel token in a gathered one.
            tok = tok_next
            tok_next = tl.load(slot_token_ptr + slots + BLOCK_K,
                               mask=slots + BLOCK_K < num_slots, other=num_tokens)
            l_mask = m_ok[:, None]
            r_mask = n_ok[None, :]
            if GATHER_L:
                row_l = tok
                l_mask = (tok < num_tokens)[None, :] & m_ok[:, None]
            if GATHER_R:
                row_r = tok
                r_mask = (tok < num_tokens)[:, None] & n_ok[None, :]
        else:
            k_ok = offs_k + k0 < count
            l_mask = k_ok[None, :] & m_ok[:, None]
            r_mask = k_ok[:, None] & n_ok[None, :]
            if GATHER_L:
                row_l = tl.load(slot_token_ptr + slots, mask=k_ok, other=0)
            if GATHER_R:
                row_r = tl.load(slot_token_ptr + slots, mask=k_ok, other=0)
        # L^T tile [BLOCK_M, BLOCK_K]: column k of it is row row_l[k] of L.
        if L_TMA:
            lt = l_desc.load([start + k0, pid_m * BLOCK_M]).T
        else:
            lt = tl.load(l_ptr + row_l.to(tl.int64)[None, :] * stride_l + offs_m[:, None],
                         mask=l_mask, other=0.0)
        if R_TMA:
            r = r_desc.load([start + k0, pid_n * BLOCK_N])
        else:
            r = tl.load(r_ptr + row_r.to(tl.int64)[:, None] * stride_r + offs_n[None, :],
                        mask=r_mask, other=0.0)
        acc = tl.dot(lt, r, acc)

    if OUT_TMA:
        # dW as [E * M, N] (M a multiple of BLOCK_M): the tile goes out by an asynchronous
        # bulk store, and the program moves on while the copy engine drains it.
        dw_desc.store([expert * M + pid_m * BLOCK_M, pid_n * BLOCK_N],
                      acc.to(dw_ptr.dtype.element_ty))
    else:
        dw_ptrs = (dw_ptr + expert.to(tl.int64) * stride_dwe
                   + offs_m.to(tl.int64)[:, None] * stride_dwm + offs_n[None, :])
        if ACCUMULATE:
            acc += tl.load(dw_ptrs, mask=m_ok[:, None] & n_ok[None, :],
                           other=0.0).to(tl.float32)
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _expert_wgrad_kernel(
    l_ptr, r_ptr, l_desc, r_desc, dw_ptr, dw_desc, slot_token_ptr, expert_start_ptr,
    expert_count_ptr, M, N, num_tokens, num_slots, num_tiles, stride_l, stride_r, stride_dwe,
    stride_dwm,
    GATHER_L: tl.constexpr, GATHER_R: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PADDED: tl.constexpr, L_TMA: tl.constexpr, R_TMA: tl.constexpr,
    OUT_TMA: tl.constexpr, PERSISTENT: tl.constexpr,
):
    if PERSISTENT:
        # One program an SM walks the tiles in the same order; the K loop inside stays the
        # one-tile loop (pipelined alone), so every tile sums the same terms in the same order.
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _wgrad_tile(tile, l_ptr, r_ptr, l_desc, r_desc, dw_ptr, dw_desc, slot_token_ptr,
                        expert_start_ptr, expert_count_ptr, M, N, num_tokens, num_slots,
                        stride_l, stride_r, stride_dwe, stride_dwm, GATHER_L, GATHER_R,
                        ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PADDED, L_TMA, R_TMA,
                        OUT_TMA)
    else:
        _wgrad_tile(tl.program_id(0), l_ptr, r_ptr, l_desc, r_desc, dw_ptr, dw_desc,
                    slot_token_ptr, expert_start_ptr, expert_count_ptr, M, N, num_tokens,
                    num_slots, stride_l, stride_r, stride_dwe, stride_dwm, GATHER_L, GATHER_R,
                    ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PADDED, L_TMA, R_TMA,
                    OUT_TMA)


def expert_wgrad(l_rows, r_rows, routes: RouteList, out_EMN, gather_l: bool, gather_r: bool,
                 cfg: GemmConfig | None = None, accumulate: bool = False):
    """Fill out_EMN [E, M, N] (every element) with the per-expert sums above, or add them
    to it (`accumulate`)."""
    num_experts, m, n = out_EMN.shape
    cfg = cfg or wgrad_config(n, l_rows.device)
    padded = PADDED_K and routes.block_m % cfg.block_k == 0
    if (cfg.warp_specialize and padded
            and _warp_specialized(l_rows, r_rows, routes, out_EMN, gather_l, gather_r, cfg,
                                  accumulate)):
        return out_EMN
    l_desc = r_desc = None
    if padded and cfg.tma and tma.tma_available(l_rows.device):
        # The slot-order operand (there is one: a gathered one has no rows to box) by TMA.
        if not gather_l and tma.matrix_fits(l_rows, (cfg.block_k, cfg.block_m)):
            l_desc = tma.descriptor(l_rows, (cfg.block_k, cfg.block_m))
        if not gather_r and tma.matrix_fits(r_rows, (cfg.block_k, cfg.block_n)):
            r_desc = tma.descriptor(r_rows, (cfg.block_k, cfg.block_n))
    LAST_WGRAD_PLAN[gather_l] = (padded, l_desc is not None or r_desc is not None)
    LAST_WGRAD_WS[gather_l] = False
    dw_desc = _out_desc(out_EMN, cfg, accumulate)
    num_tiles = num_experts * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    persistent = cfg.persistent and tma.persistent_available()
    LAST_WGRAD_STORE[gather_l] = (persistent, dw_desc is not None)
    grid = (min(num_tiles, tma.num_programs(l_rows.device)) if persistent else num_tiles,)

    def launch(c):
        _expert_wgrad_kernel[grid](
            l_rows, r_rows, l_rows if l_desc is None else l_desc,
            r_rows if r_desc is None else r_desc, out_EMN,
            out_EMN if dw_desc is None else dw_desc, routes.slot_token,
            routes.expert_starts, routes.expert_counts, m, n, routes.token_slots.shape[0],
            routes.num_slots, num_tiles, l_rows.stride(0), r_rows.stride(0), out_EMN.stride(0),
            out_EMN.stride(1), GATHER_L=gather_l, GATHER_R=gather_r, ACCUMULATE=accumulate,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
            PADDED=padded, L_TMA=l_desc is not None, R_TMA=r_desc is not None,
            OUT_TMA=dw_desc is not None, PERSISTENT=persistent, **c.launch_options())

    if not l_rows.is_cuda:
        launch(cfg)
    else:  # fp32 operands need twice a stage's shared memory: fewer stages, same sums
        gl.fitted("wgrad", cfg, (l_rows.dtype, m, n, gather_l, dw_desc is not None), launch)
    return out_EMN


def _warp_specialized(l_rows, r_rows, routes: RouteList, out_EMN, gather_l: bool,
                      gather_r: bool, cfg: GemmConfig, accumulate: bool) -> bool:
    """expert_wgrad through wgrad_ws.py's kernel where the GPU is a Hopper and the launch fits
    (True); False (nothing written) otherwise, or where its launch fails
    (gemm_launch.gluon_launch: then the Triton kernel)."""
    _, m, n = out_EMN.shape
    if not (wgrad_ws.available(l_rows.device)
            and wgrad_ws.fits(l_rows, r_rows, out_EMN, gather_l, gather_r, cfg.block_m,
                              cfg.block_n, cfg.block_k, accumulate)):
        return False
    ran = gl.gluon_launch("wgrad", (cfg, gather_l, l_rows.dtype, m, n),
                          lambda: wgrad_ws.expert_wgrad_ws(
                              l_rows, r_rows, routes.slot_token, routes.expert_starts,
                              routes.expert_counts, routes.token_slots.shape[0],
                              routes.num_slots, out_EMN, gather_l, cfg.block_m, cfg.block_n,
                              cfg.block_k, cfg.group_m, cfg.num_stages,
                              tma.num_programs(l_rows.device)))
    if ran:
        LAST_WGRAD_PLAN[gather_l] = (True, True)
        LAST_WGRAD_STORE[gather_l] = (True, True)
        LAST_WGRAD_WS[gather_l] = True
    return ran


def _out_desc(out_EMN, cfg: GemmConfig, accumulate: bool):
    """dW as one [E * M, N] store descriptor (boxes [BLOCK_M, BLOCK_N]) where the config asks
    for it and it fits: a box must not run past an expert's M rows, so M % BLOCK_M == 0; an
    accumulating launch keeps the pointer store (it reads the tile first); so does a 4-byte
    dW on a GPU, whose staging tile would not fit beside the pipeline in shared memory (the
    interpreter has no such limit, so the CPU tests run the store in fp32)."""
    num_experts, m, n = out_EMN.shape
    if not cfg.store_tma or accumulate or m % cfg.block_m or not out_EMN.is_contiguous():
        return None
    if out_EMN.is_cuda and out_EMN.element_size() > 2:
        return None
    if not tma.tma_available(out_EMN.device):
        return None
    flat = out_EMN.view(num_experts * m, n)
    if not tma.matrix_fits(flat, (cfg.block_m, cfg.block_n)):
        return None
    return tma.descriptor(flat, (cfg.block_m, cfg.block_n))


@triton.jit
def _expert_bias_grad_kernel(
    r_ptr, weights_ptr, db_ptr, slot_token_ptr, slot_route_ptr, expert_start_ptr,
    expert_count_ptr, N, num_routes, stride_r, stride_dbe,
    GATHER_R: tl.constexpr, SCALE_BY_P: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    expert = tl.program_id(0) // tiles_n
    offs_n = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    n_ok = offs_n < N
    start = tl.load(expert_start_ptr + expert)
    count = tl.load(expert_count_ptr + expert)

    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, count, BLOCK_S):
        s_ok = offs_s + s0 < count
        slots = start + s0 + offs_s
        if GATHER_R:
            row = tl.load(slot_token_ptr + slots, mask=s_ok, other=0)
        else:
            row = slots
        r = tl.load(r_ptr + row.to(tl.int64)[:, None] * stride_r + offs_n[None, :],
                    mask=s_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if SCALE_BY_P:
            route = tl.load(slot_route_ptr + slots, mask=s_ok, other=num_routes)
            p = tl.load(weights_ptr + route, mask=route < num_routes, other=0.0)
            r = r * p.to(tl.float32)[:, None]
        acc += r
    db = tl.sum(acc, axis=0)

    db_ptrs = db_ptr + expert.to(tl.int64) * stride_dbe + offs_n
    if ACCUMULATE:
        db += tl.load(db_ptrs, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(db_ptrs, db.to(db_ptr.dtype.element_ty), mask=n_ok)


def expert_bias_grad(r_rows, routes: RouteList, out_EN, gather_r: bool,
                     topk_weights_N=None, accumulate: bool = False):
    """Fill out_EN [E, N] (every element) with the per-expert bias sums above (scaled by the
    route weight when `topk_weights_N` is given), or add them to it (`accumulate`)."""
    num_experts, n = out_EN.shape
    if r_rows.is_cuda:
        block_s, block_n, warps = 32, min(256, triton.next_power_of_2(n)), 4
    else:
        block_s, block_n, warps = 16, min(32, triton.next_power_of_2(n)), 1
    grid = (num_experts * triton.cdiv(n, block_n),)
    scale = topk_weights_N is not None
    _expert_bias_grad_kernel[grid](
        r_rows, topk_weights_N if scale else r_rows, out_EN, routes.slot_token,
        routes.slot_route, routes.expert_starts, routes.expert_counts,
        n, topk_weights_N.numel() if scale else 0, r_rows.stride(0), out_EN.stride(0),
        GATHER_R=gather_r, SCALE_BY_P=scale, ACCUMULATE=accumulate, BLOCK_S=block_s,
        BLOCK_N=block_n, num_warps=warps, enable_fp_fusion=FUSED)
    return out_EN
