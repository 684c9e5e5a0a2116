"""Slot GEMMs: per-expert GEMMs over the RouteList's slot blocks, gathers riding the A-tile load.

Layout contract (S slots, BM-blocks of one expert each, see route_align.py; T tokens, H hidden,
F ffn width, E experts; all tensors row-major with a contiguous last dimension):
- `fc1_swiglu`: Y1[s] = X[slot_token[s]] @ w_gate_up[e(s)]^T  ->  Y1 [S, 2F] (input dtype), and
  in the same epilogue A[s] = silu(g) * u * p  ->  A [S, F]. X [T, H], w_gate_up [E, 2F, H].
  One program owns matching column tiles of gate (columns n) and up (columns F + n).
  Optional (constexpr, no cost when off): a bias b [E, 2F] added to the fp32 accumulator of
  real rows before Y1 is rounded (HAS_BIAS), and the clamped SwiGLU of gated_act.py (CLAMPED).
- `slot_gemm`: C[s] = A[s] @ w[e(s)]^T (w [E, N, K], FC2) or A[s] @ w[e(s)] (w [E, K, N], dX
  of FC1); A [S, K] is read in slot order, no gather. Optional (HAS_BIAS, FC2): C[s] +=
  p(s) * b[e(s)] in fp32 before the rounding, p(s) the slot's route weight (0 for padding).
- `dact_swiglu`: dA[s] = dOut[slot_token[s]] @ w_down[e(s)] (w_down [E, H, F]) with the
  activation backward in the epilogue: writes dY1 [S, 2F], the recomputed A [S, F] (for the
  dW_down wgrad) and dp_part [S, cdiv(F, BN)] fp32, the per-column-tile partial sums of
  d(route probability); the caller reduces its rows in a fixed order (no atomics). CLAMPED
  picks the clamped SwiGLU backward.
Sentinel and padding rules: a padding slot (slot_token == T, slot_route == T*k) reads its
gathered row as zeros through the load mask (never a real row) and its probability as 0, so
every row of a live block is written with finite values (zeros for padding slots). Blocks with
block_expert == -1 exit at once: their rows are never written and never read by anything that
feeds a real result. Row index * row stride is formed in int64.
Tile configs are picked on the host from static shapes (no autotune: the kernels are captured
in CUDA graphs); BLOCK_M must divide the RouteList's block_m.

Variants (GemmConfig fields; each falls back to the pointer path where it cannot run, see
tma.py; the default is the pointer path with one program per tile):
- `tma`: weight tiles (and, in slot_gemm, the slot-order A tiles) load through host-side TMA
  tensor descriptors. The gathered A tiles of fc1_swiglu / dact_swiglu stay pointer loads. A
  weight w [E, R, C] is one [E*R, C] descriptor: a tile that runs past an expert's R rows
  reads the next expert's rows, which is harmless where those rows only feed output columns
  the store masks off (w [E, N, K]: fc1, fc2); where they would be contracted (w [E, K, N]:
  dact, dX) the TMA path is taken only when K is a multiple of BLOCK_K.
- `persistent`: one program per SM looping over the live tiles (`tl.range`). Each program
  first writes the list of live M blocks (and their experts) into its rows of a
  [grid, 2, S / BLOCK_M] int32 scratch the launcher allocates. Tiles of -1 blocks
  are then never visited, and every tile runs the same K loop, with bounds that do not
  depend on the tile -- which lets `flatten` (default on) fuse the tile and K loops, so the
  pipeliner overlaps one tile's epilogue with the next tile's loads.
- `warp_specialize` (persistent + tma, slot_gemm only, block_m 128): passed to that tl.range.
  On Hopper (Triton 3.6) the pass splits a loop whose loads are all TMA into a producer warp
  group and two consumer warp groups of 64 rows (num_warps=4 -> 12 warps), and only when the
  loop is not flattened, so flatten is dropped there. The gathered kernels ignore it: the pass
  asserts on their pointer loads.
- `split_tail` (where the tile is the whole route block): two launches, the second running
  each expert's last block, when it holds at most block_m / 2 real rows, as a half-height tile
  (`slot_schedule.py`; about 5.6% of the FC1 / FC2 work at 512 uniform routes per expert).
  Its tile keeps BN, BK and the K order, so each output element sums the same terms in the
  same order; the half-height MMA is the only change (bitwise equal on the H200). Off in the
  product: on the H200 the second launch cost more than it saved, at every tail tile tried
  (benchmarks/experts_ab.py; results/NOTES.md, the fifth session of 2026-11-30).
- `paired` (fc1_swiglu with `tma`, 2 BN <= 256): w_gate_up [E, 2F, H] is described as
  [2E, F, H], so one [2, BN, BK] box holds the gate and the up rows of a column tile; it is
  the [2 BN, BK] operand of one [BM, 2 BN] dot a K step (instead of two [BM, BN] dots, each
  reading the A tile), and the accumulator is split into gate and up in the epilogue. A box
  past F reads zeros, never the up rows. No weight layout changes. In the product (with
  `persistent` at 128-row blocks): on the H200, T = 8192, FC1 0.79-0.82 ms against 0.87-0.90
  unpaired (benchmarks/experts_ab.py; results/NOTES.md, the sixth session of 2026-11-30).
Every variant computes each output tile with the default's tile shape and K order, so on a GPU
its results are bitwise equal to the default path's (the cuda tests check it). In the
interpreter too, except the transposed TMA weight tile of fc1 / fc2, which numpy's matmul sums
in another order (equal to 1e-6), and the split tail's half-height tiles (likewise).
The shared gathered K loop (`gathered_k_loop`) serves fc1_swiglu and dact_swiglu.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import tma
from .env import flag_from_env, ints_from_env
from .gated_act import gated_backward, gated_forward
from .route_align import RouteList
from .slot_schedule import (live_block_list, persistent_tile, program_tile,
                            store_zero_gated_rows, store_zero_rows, tail_grid)

# Persistent launches list the live M blocks LIST_CHUNK blocks at a time (LIST_CHUNK_WS when
# warp-specialized: that list is built without a scan, by a CHUNK x CHUNK comparison).
LIST_CHUNK = 1024
LIST_CHUNK_WS = 128


# FC1's TMA variant may also write Y1 and A through TMA store descriptors where F is a
# multiple of the column tile (MOEGRAPH_FC1_TMA_STORE=1). Off: benchmarks/experts_ab.py on the
# H200, T = 8192, 128 x (2 x 128) tile: 1.043 ms against 0.888 ms with pointer stores.
FC1_TMA_STORE = flag_from_env("MOEGRAPH_FC1_TMA_STORE", False)

# FC1's TMA variant loads gate and up as one [2, BN, BK] box and runs one [BM, 2 BN] dot a K
# step (GemmConfig.paired; the product's choice in moe/experts.tile_configs unless
# MOEGRAPH_FC1_PAIRED=0).
FC1_PAIRED = flag_from_env("MOEGRAPH_FC1_PAIRED", True)

# Off: on the H200 with Triton 3.6 (2026-11-30) the warp-specialized persistent TMA slot_gemm
# compiled but its first launch failed with "operation not supported on global/shared address
# space" and lost the CUDA context (not recoverable, so no fallback can catch it). A config
# asking for it runs the persistent TMA kernel without warp specialization.
WARP_SPECIALIZE_ENABLED = False


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # Variants of fc1_swiglu / slot_gemm / dact_swiglu (see the module docstring); wgrad
    # ignores them. Defaults keep the pointer path, one program per tile.
    tma: bool = False
    persistent: bool = False
    flatten: bool = True  # persistent only
    warp_specialize: bool = False  # persistent only
    # Where block_m is the route block: leave each expert's last block, when it holds at most
    # block_m / 2 real rows, to a second launch of block_m / 2-row tiles (slot_schedule.py).
    split_tail: bool = False
    # fc1_swiglu with TMA: gate and up weight tiles as one [2, BN, BK] box of w_gate_up seen
    # as [2E, F, H], one [BM, 2BN] dot a K step (2 * BN <= 256). Other kernels ignore it.
    paired: bool = False

    @property
    def variant(self) -> str:
        """Short name: 'base', 'tma', 'persistent', 'tma+persistent', '+ws', '+noflat', '+tail'."""
        parts = (["tma"] if self.tma else []) + (["persistent"] if self.persistent else [])
        if self.persistent and self.warp_specialize:
            parts.append("ws")
        if self.persistent and not self.flatten:
            parts.append("noflat")
        if self.split_tail:
            parts.append("tail")
        if self.paired:
            parts.append("pair")
        return "+".join(parts) or "base"

    def with_variant(self, name: str) -> GemmConfig:
        """This tile under the variant `name` ('base', 'tma', 'tma+persistent+ws', ...: the
        `variant` property's spelling)."""
        parts = set(name.split("+")) - {"base"}
        unknown = parts - {"tma", "persistent", "ws", "noflat", "tail", "pair"}
        if unknown:
            raise ValueError(f"GemmConfig: unknown variant part {sorted(unknown)[0]!r} in "
                             f"{name!r}; parts are tma, persistent, ws, noflat, tail, pair")
        return self._replace(tma="tma" in parts, persistent="persistent" in parts,
                             warp_specialize="ws" in parts, flatten="noflat" not in parts,
                             split_tail="tail" in parts, paired="pair" in parts)


class Plan(NamedTuple):
    """What a launch actually ran: the requested variant minus what was not available."""
    tma: bool
    persistent: bool
    flatten: bool
    warp_specialize: bool
    grid: int
    fallback: str = ""  # why the requested variant was replaced by the pointer path
    tail: bool = False  # a second launch of half-height tiles ran the experts' last blocks
    store_tma: bool = False  # FC1 wrote Y1 and A through TMA store descriptors
    paired: bool = False  # FC1 loaded gate and up as one [2, BN, BK] box, one dot


# The plan of the latest launch of each kernel ("fc1", "fc2"/"dx" by w_nk, "dact"), for tests
# and benchmarks that must know whether a variant fell back.
LAST_PLAN: dict[str, Plan] = {}

# On a GPU, a variant whose kernel fails to compile or launch (a Triton without a pass this
# kernel needs, shared memory over the limit) is remembered, warned about once and replaced by
# the pointer path. Benchmarks set this False to see the error instead.
FALLBACK_ON_ERROR = True
_FAILED_VARIANTS: dict[tuple, str] = {}


def route_block_m(num_routes: int, num_experts: int, device: torch.device) -> int:
    """Slot block size of the RouteList: the largest M tile the slot GEMMs will use."""
    if device.type != "cuda":
        return 16
    # Padding costs up to block_m - 1 slots per expert; with few routes per expert a 64-row
    # block wastes half as much as 128 rows.
    return 128 if num_routes >= 256 * num_experts else 64


def _cuda_config(block_m: int, n: int, block_n: int, block_k: int = 64, stages: int = 3):
    while block_n > 64 and n % block_n:
        block_n //= 2
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return GemmConfig(block_m, block_n, block_k, 8, warps, stages)


TILE_FIELDS = "bm,bn,bk,group,warps,stages"


def tile_from_env(name: str) -> GemmConfig | None:
    tile = ints_from_env(name, TILE_FIELDS)
    return None if tile is None else GemmConfig(*tile)


# FC1 and FC2 tiles chosen by benchmarks/tile_sweep.py, from MOEGRAPH_FC1_TILE /
# MOEGRAPH_FC2_TILE, read once at import. Each applies where the slot block is at least its
# block_m; the variant (TMA, persistent) stays the product's.
FC1_TILE_OVERRIDE = tile_from_env("MOEGRAPH_FC1_TILE")
FC2_TILE_OVERRIDE = tile_from_env("MOEGRAPH_FC2_TILE")


def fc1_config(ffn: int, block_m: int, device: torch.device) -> GemmConfig:
    """block_n is per half: a program computes [BM, BN] of gate and [BM, BN] of up."""
    if device.type != "cuda":
        return GemmConfig(block_m, 32, 32, 4, 4, 1)
    if FC1_TILE_OVERRIDE is not None and FC1_TILE_OVERRIDE.block_m <= block_m:
        return FC1_TILE_OVERRIDE
    if block_m >= 128:
        # 128-row blocks (many routes per expert): K tile 64, 4 stages, (128*64 + 256*64) *
        # 2 B = 48 KB/stage, 192 KB; group 4. `benchmarks/tile_sweep.py` on the H200, Qwen3
        # shape, T=8192, TMA weights, bitwise equal: 0.837 -> 0.795 ms (493 -> 519 TFLOP/s).
        return _cuda_config(128, ffn, 128, block_k=64, stages=4)._replace(group_m=4)
    # Smaller blocks: a block_m x (2 x 128) output tile, K tile 32, 5 stages: 120 KB at 128
    # rows. Chosen by `benchmarks/moe_experts.py --sweep` on the H200 before the TMA variant.
    return _cuda_config(block_m, ffn, 128, block_k=32, stages=5)


def slot_gemm_config(n: int, block_m: int, device: torch.device) -> GemmConfig:
    if device.type != "cuda":
        return GemmConfig(block_m, 32, 32, 4, 4, 1)
    # 128 x 256 x 64, 3 stages: 48 KB/stage, 144 KB of the 228 KB shared memory.
    return _cuda_config(min(block_m, 128), n, 256)


def fc2_config(hidden: int, block_m: int, device: torch.device) -> GemmConfig:
    """FC2's tile: the slot GEMM's, or MOEGRAPH_FC2_TILE where it fits (dX keeps its own)."""
    if device.type == "cuda" and FC2_TILE_OVERRIDE is not None \
            and FC2_TILE_OVERRIDE.block_m <= block_m:
        return FC2_TILE_OVERRIDE
    if device.type == "cuda" and block_m >= 128:
        # 4 stages instead of 3 (192 KB): `benchmarks/tile_sweep.py --kernel fc2` on the H200,
        # Qwen3 shape, T=8192, TMA + persistent, bitwise equal: 0.383 -> 0.373 ms.
        return _cuda_config(128, hidden, 256, stages=4)
    return slot_gemm_config(hidden, block_m, device)


def dact_config(ffn: int, block_m: int, device: torch.device) -> GemmConfig:
    if device.type != "cuda":
        return GemmConfig(block_m, 32, 32, 4, 4, 1)
    # The epilogue reads two Y1 tiles and writes three: keep the tile at 128 x 128.
    return _cuda_config(min(block_m, 128), ffn, 128, stages=4)


# ---------------------------------------------------------------------------------------------
# The gathered K loop shared by fc1_swiglu and dact_swiglu.


@triton.jit
def gathered_k_loop(acc0, acc1, a_ptrs, row_ok, k_size,
                    b0_ptrs, b1_ptrs, b_step, n_ok, b_desc, b_row, b_col, b1_row_offset,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                    TWO_B: tl.constexpr, B_TMA: tl.constexpr, B_NK: tl.constexpr,
                    B_PAIR: tl.constexpr = False):
    """acc0 += A @ B0 (and acc1 += A @ B1 if TWO_B) over k in [0, k_size), BLOCK_K at a time.

    A [BM, BK]: gathered rows, a_ptrs already offset by slot_token; padding rows (row_ok
    False) and columns past k_size read zeros. B [BK, BN] comes from pointers (b0_ptrs /
    b1_ptrs, advanced by b_step; columns past n_ok and rows past k_size read zeros) or, with
    B_TMA, from the descriptor b_desc: B_NK tiles [BN, BK] at (b_row, k) and
    (b_row + b1_row_offset, k), transposed; otherwise tiles [BK, BN] at (b_row + k, b_col).
    B_PAIR (with B_TMA, B_NK, not TWO_B): b_desc is 3-D, its [2, BN, BK] box at (b_row, b_col,
    k) is the [2 BN, BK] tile B0, transposed.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, k_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = offs_k + k0 < k_size
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_TMA:
            if B_PAIR:
                pair = b_desc.load([b_row, b_col, k0])
                b0 = tl.reshape(pair, (2 * pair.shape[1], pair.shape[2])).T
            elif B_NK:
                b0 = b_desc.load([b_row, k0]).T
                if TWO_B:
                    b1 = b_desc.load([b_row + b1_row_offset, k0]).T
            else:
                b0 = b_desc.load([b_row + k0, b_col])
        elif EVEN_K:
            if EVEN_N:
                b0 = tl.load(b0_ptrs)
                if TWO_B:
                    b1 = tl.load(b1_ptrs)
            else:
                b0 = tl.load(b0_ptrs, mask=n_ok[None, :], other=0.0)
                if TWO_B:
                    b1 = tl.load(b1_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            b0 = tl.load(b0_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if TWO_B:
                b1 = tl.load(b1_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc0 = tl.dot(a, b0, acc0)
        if TWO_B:
            acc1 = tl.dot(a, b1, acc1)
        a_ptrs += BLOCK_K
        if not B_TMA:
            b0_ptrs += b_step
            if TWO_B:
                b1_ptrs += b_step
    return acc0, acc1


# ---------------------------------------------------------------------------------------------
# FC1 + SwiGLU.


@triton.jit
def _fc1_swiglu_tile(
    pid_m, pid_n, expert,
    x_ptr, w_ptr, w_desc, weights_ptr, slot_token_ptr, slot_route_ptr, y1_ptr, act_ptr,
    y1_desc, act_desc, bias_ptr, alpha, limit,
    num_tokens, num_routes, ffn, hidden,
    stride_xt, stride_we, stride_wn, stride_y1, stride_act, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, Y_TMA: tl.constexpr,
    PAIRED: tl.constexpr,
):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tok = tl.load(slot_token_ptr + offs_m)
    row_ok = tok < num_tokens
    n_ok = offs_n < ffn

    x_ptrs = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    wg_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
               + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None])
    wu_ptrs = wg_ptrs + ffn * stride_wn
    if PAIRED:  # w_desc over w as [2E, F, H]: box (2e, n, k) = gate rows n.., up rows n..
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        acc, _ = gathered_k_loop(
            acc, acc, x_ptrs, row_ok, hidden, wg_ptrs, wg_ptrs, BLOCK_K, n_ok,
            w_desc, 2 * expert, pid_n * BLOCK_N, 0,
            BLOCK_K=BLOCK_K, EVEN_K=EVEN_K, EVEN_N=EVEN_N, TWO_B=False, B_TMA=True, B_NK=True,
            B_PAIR=True)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # TMA: w_gate_up as [E * 2F, H]; gate rows e*2F + n, up rows e*2F + F + n.
        acc_g, acc_u = gathered_k_loop(
            acc_g, acc_u, x_ptrs, row_ok, hidden, wg_ptrs, wu_ptrs, BLOCK_K, n_ok,
            w_desc, expert * 2 * ffn + pid_n * BLOCK_N, 0, ffn,
            BLOCK_K=BLOCK_K, EVEN_K=EVEN_K, EVEN_N=EVEN_N, TWO_B=True, B_TMA=USE_TMA, B_NK=True)

    if HAS_BIAS:  # b_gate_up[e] in fp32 into the accumulator; padding rows stay zero
        b_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + offs_n
        b_g = tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)
        b_u = tl.load(b_ptrs + ffn, mask=n_ok, other=0.0).to(tl.float32)
        acc_g += tl.where(row_ok[:, None], b_g[None, :], 0.0)
        acc_u += tl.where(row_ok[:, None], b_u[None, :], 0.0)
    # Round g and u to the stored dtype first: backward recomputes A from the stored Y1.
    g = acc_g.to(y1_ptr.dtype.element_ty)
    u = acc_u.to(y1_ptr.dtype.element_ty)
    route = tl.load(slot_route_ptr + offs_m)
    p = tl.load(weights_ptr + route, mask=route < num_routes, other=0.0).to(tl.float32)
    act = gated_forward(g.to(tl.float32), u.to(tl.float32), p[:, None], alpha, limit, CLAMPED)
    if Y_TMA:  # whole column tiles (F % BN == 0): the boxes never cross gate into up
        y1_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], g)
        y1_desc.store([pid_m * BLOCK_M, ffn + pid_n * BLOCK_N], u)
        act_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], act.to(act_ptr.dtype.element_ty))
    else:
        rows = offs_m.to(tl.int64)[:, None]
        out_mask = n_ok[None, :]
        y1_ptrs = y1_ptr + rows * stride_y1 + offs_n[None, :]
        tl.store(y1_ptrs, g, mask=out_mask)
        tl.store(y1_ptrs + ffn, u, mask=out_mask)
        tl.store(act_ptr + rows * stride_act + offs_n[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _fc1_swiglu_kernel(
    x_ptr, w_ptr, w_desc, weights_ptr, slot_token_ptr, slot_route_ptr, block_expert_ptr,
    live_list_ptr, expert_counts_ptr, expert_starts_ptr, num_experts, y1_ptr, act_ptr, y1_desc,
    act_desc, bias_ptr, alpha, limit, num_tokens, num_routes, num_slots, ffn, hidden,
    stride_xt, stride_we, stride_wn, stride_y1, stride_act, stride_be,
    ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
    LIST_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    TAIL: tl.constexpr, Y_TMA: tl.constexpr, PAIRED: tl.constexpr,
):
    num_blocks = num_slots // BLOCK_M
    num_pid_n = tl.cdiv(ffn, BLOCK_N)
    if PERSISTENT:
        live_list_ptr += tl.program_id(0) * 2 * num_blocks
        num_live = live_block_list(block_expert_ptr, live_list_ptr, num_blocks, slot_route_ptr,
                                   num_routes, expert_counts_ptr, expert_starts_ptr, num_experts,
                                   num_slots, BLOCK_M, ROUTE_BLOCK, LIST_CHUNK, False, TAIL)
        num_tiles = num_live * num_pid_n
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                             flatten=FLATTEN):
            pid_m, pid_n, expert = persistent_tile(tile, live_list_ptr, num_live, num_blocks,
                                                   num_pid_n, GROUP_M)
            _fc1_swiglu_tile(
                pid_m, pid_n, expert, x_ptr, w_ptr, w_desc, weights_ptr,
                slot_token_ptr, slot_route_ptr, y1_ptr, act_ptr, y1_desc, act_desc, bias_ptr,
                alpha, limit, num_tokens, num_routes, ffn, hidden,
                stride_xt, stride_we, stride_wn, stride_y1, stride_act, stride_be,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, HAS_BIAS, CLAMPED, Y_TMA,
                PAIRED)
            if TAIL == 2:
                store_zero_gated_rows(y1_ptr, act_ptr, (pid_m + 1) * BLOCK_M, stride_y1,
                                      stride_act, pid_n, ffn, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n, expert, ok = program_tile(
            tl.program_id(0), num_blocks, num_pid_n, block_expert_ptr, slot_route_ptr,
            num_routes, expert_counts_ptr, expert_starts_ptr, num_slots, GROUP_M, BLOCK_M,
            ROUTE_BLOCK, TAIL)
        if not ok:
            return
        _fc1_swiglu_tile(
            pid_m, pid_n, expert, x_ptr, w_ptr, w_desc, weights_ptr, slot_token_ptr,
            slot_route_ptr, y1_ptr, act_ptr, y1_desc, act_desc, bias_ptr, alpha, limit,
            num_tokens, num_routes, ffn, hidden,
            stride_xt, stride_we, stride_wn, stride_y1, stride_act, stride_be,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, HAS_BIAS, CLAMPED, Y_TMA,
            PAIRED)
        if TAIL == 2:
            store_zero_gated_rows(y1_ptr, act_ptr, (pid_m + 1) * BLOCK_M, stride_y1, stride_act,
                                  pid_n, ffn, BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------------
# Slot-order GEMM (FC2, dX).


@triton.jit
def _slot_gemm_tile(
    pid_m, pid_n, expert,
    a_ptr, a_desc, w_ptr, w_desc, c_ptr, N, K,
    stride_a, stride_we, stride_w, stride_c,
    bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
    W_NK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if W_NK:  # w[e] is [N, K]: C = A @ w[e]^T
        w_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
        w_step = BLOCK_K
        w_row = expert * N + pid_n * BLOCK_N  # TMA: w as [E * N, K]
    else:  # w[e] is [K, N]: C = A @ w[e]
        w_ptrs = w_base + offs_k.to(tl.int64)[:, None] * stride_w + offs_n[None, :]
        w_step = BLOCK_K * stride_w
        w_row = expert * K  # TMA: w as [E * K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if USE_TMA:
            a = a_desc.load([pid_m * BLOCK_M, k0])
            if W_NK:
                b = w_desc.load([w_row, k0]).T
            else:
                b = w_desc.load([w_row + k0, pid_n * BLOCK_N])
        elif EVEN_K:
            a = tl.load(a_ptrs)
            if EVEN_N:
                b = tl.load(w_ptrs)
            else:
                b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        if not USE_TMA:
            a_ptrs += BLOCK_K
            w_ptrs += w_step
    if HAS_BIAS:  # FC2: p * b_down[e] in fp32 before the one rounding (p = 0 on padding)
        route = tl.load(slot_route_ptr + offs_m)
        p = tl.load(weights_ptr + route, mask=route < num_routes, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok,
                    other=0.0).to(tl.float32)
        acc += p[:, None] * b[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _slot_gemm_kernel(
    a_ptr, a_desc, w_ptr, w_desc, c_ptr, block_expert_ptr, live_list_ptr,
    expert_counts_ptr, expert_starts_ptr, num_experts, num_slots, N, K,
    stride_a, stride_we, stride_w, stride_c,
    bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
    W_NK: tl.constexpr, ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, LIST_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr,
    TAIL: tl.constexpr,
):
    num_blocks = num_slots // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        live_list_ptr += tl.program_id(0) * 2 * num_blocks
        num_live = live_block_list(block_expert_ptr, live_list_ptr, num_blocks, slot_route_ptr,
                                   num_routes, expert_counts_ptr, expert_starts_ptr, num_experts,
                                   num_slots, BLOCK_M, ROUTE_BLOCK, LIST_CHUNK, WARP_SPECIALIZE,
                                   TAIL)
        num_tiles = num_live * num_pid_n
        if WARP_SPECIALIZE:
            for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                                 flatten=FLATTEN, warp_specialize=True):
                pid_m, pid_n, expert = persistent_tile(tile, live_list_ptr, num_live, num_blocks,
                                                       num_pid_n, GROUP_M)
                _slot_gemm_tile(pid_m, pid_n, expert, a_ptr, a_desc, w_ptr, w_desc, c_ptr,
                                N, K, stride_a, stride_we, stride_w, stride_c,
                                bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
                                W_NK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA,
                                HAS_BIAS)
        else:
            for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                                 flatten=FLATTEN):
                pid_m, pid_n, expert = persistent_tile(tile, live_list_ptr, num_live, num_blocks,
                                                       num_pid_n, GROUP_M)
                _slot_gemm_tile(pid_m, pid_n, expert, a_ptr, a_desc, w_ptr, w_desc, c_ptr,
                                N, K, stride_a, stride_we, stride_w, stride_c,
                                bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
                                W_NK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA,
                                HAS_BIAS)
                if TAIL == 2:
                    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                    store_zero_rows(c_ptr, (pid_m + 1) * BLOCK_M, stride_c, offs_n, offs_n < N,
                                    BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n, expert, ok = program_tile(
            tl.program_id(0), num_blocks, num_pid_n, block_expert_ptr, slot_route_ptr,
            num_routes, expert_counts_ptr, expert_starts_ptr, num_slots, GROUP_M, BLOCK_M,
            ROUTE_BLOCK, TAIL)
        if not ok:
            return
        _slot_gemm_tile(pid_m, pid_n, expert, a_ptr, a_desc, w_ptr, w_desc, c_ptr, N, K,
                        stride_a, stride_we, stride_w, stride_c,
                        bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
                        W_NK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, HAS_BIAS)
        if TAIL == 2:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            store_zero_rows(c_ptr, (pid_m + 1) * BLOCK_M, stride_c, offs_n, offs_n < N,
                            BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------------
# dA (gathered dOut @ w_down) + SwiGLU backward.


@triton.jit
def _dact_swiglu_tile(
    pid_m, pid_n, expert,
    dout_ptr, w_ptr, w_desc, y1_ptr, weights_ptr, slot_token_ptr, slot_route_ptr,
    dy1_ptr, act_ptr, dp_ptr, alpha, limit,
    num_tokens, num_routes, ffn, hidden,
    stride_dt, stride_we, stride_wk, stride_y1, stride_dy1, stride_act, stride_dp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, CLAMPED: tl.constexpr,
):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tok = tl.load(slot_token_ptr + offs_m)
    row_ok = tok < num_tokens
    n_ok = offs_n < ffn

    d_ptrs = dout_ptr + tok.to(tl.int64)[:, None] * stride_dt + offs_k[None, :]
    # w_down[e] is [H, F]: B[k = h, n = f], contiguous along f.
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + offs_k.to(tl.int64)[:, None] * stride_wk + offs_n[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # TMA: w_down as [E * H, F]; tile [BK, BN] at (e*H + k, n).
    acc, _ = gathered_k_loop(
        acc, acc, d_ptrs, row_ok, hidden, w_ptrs, w_ptrs, BLOCK_K * stride_wk, n_ok,
        w_desc, expert * hidden, pid_n * BLOCK_N, 0,
        BLOCK_K=BLOCK_K, EVEN_K=EVEN_K, EVEN_N=EVEN_N, TWO_B=False, B_TMA=USE_TMA, B_NK=False)

    # dA as autograd would hand it to the activation: rounded to the input dtype.
    da = acc.to(dy1_ptr.dtype.element_ty).to(tl.float32)
    rows = offs_m.to(tl.int64)[:, None]
    tile_mask = row_ok[:, None] & n_ok[None, :]
    y1_ptrs = y1_ptr + rows * stride_y1 + offs_n[None, :]
    g = tl.load(y1_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    u = tl.load(y1_ptrs + ffn, mask=tile_mask, other=0.0).to(tl.float32)
    route = tl.load(slot_route_ptr + offs_m)
    p = tl.load(weights_ptr + route, mask=route < num_routes, other=0.0).to(tl.float32)
    dg, du, dp_part = gated_backward(da, g, u, p[:, None], alpha, limit, CLAMPED)
    act = gated_forward(g, u, p[:, None], alpha, limit, CLAMPED)
    out_mask = n_ok[None, :]
    dy1_ptrs = dy1_ptr + rows * stride_dy1 + offs_n[None, :]
    tl.store(dy1_ptrs, dg.to(dy1_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dy1_ptrs + ffn, du.to(dy1_ptr.dtype.element_ty), mask=out_mask)
    tl.store(act_ptr + rows * stride_act + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dp_ptr + offs_m.to(tl.int64) * stride_dp + pid_n, dp_part)


@triton.jit
def _zero_dact_rows(dy1_ptr, act_ptr, dp_ptr, row0, stride_dy1, stride_act, stride_dp, pid_n,
                    ffn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The all-padding second half of a tail block: dY1, A and dp_part's column pid_n."""
    store_zero_gated_rows(dy1_ptr, act_ptr, row0, stride_dy1, stride_act, pid_n, ffn, BLOCK_M,
                          BLOCK_N)
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(dp_ptr + rows * stride_dp + pid_n, tl.zeros((BLOCK_M,), dtype=tl.float32))


@triton.jit
def _dact_swiglu_kernel(
    dout_ptr, w_ptr, w_desc, y1_ptr, weights_ptr, slot_token_ptr, slot_route_ptr,
    block_expert_ptr, live_list_ptr, expert_counts_ptr, expert_starts_ptr, num_experts,
    dy1_ptr, act_ptr, dp_ptr, alpha, limit, num_tokens, num_routes, num_slots, ffn, hidden,
    stride_dt, stride_we, stride_wk, stride_y1, stride_dy1, stride_act, stride_dp,
    ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
    LIST_CHUNK: tl.constexpr, CLAMPED: tl.constexpr, TAIL: tl.constexpr,
):
    num_blocks = num_slots // BLOCK_M
    num_pid_n = tl.cdiv(ffn, BLOCK_N)
    if PERSISTENT:
        live_list_ptr += tl.program_id(0) * 2 * num_blocks
        num_live = live_block_list(block_expert_ptr, live_list_ptr, num_blocks, slot_route_ptr,
                                   num_routes, expert_counts_ptr, expert_starts_ptr, num_experts,
                                   num_slots, BLOCK_M, ROUTE_BLOCK, LIST_CHUNK, False, TAIL)
        num_tiles = num_live * num_pid_n
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                             flatten=FLATTEN):
            pid_m, pid_n, expert = persistent_tile(tile, live_list_ptr, num_live, num_blocks,
                                                   num_pid_n, GROUP_M)
            _dact_swiglu_tile(
                pid_m, pid_n, expert, dout_ptr, w_ptr, w_desc, y1_ptr, weights_ptr,
                slot_token_ptr, slot_route_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit,
                num_tokens, num_routes, ffn, hidden, stride_dt, stride_we, stride_wk,
                stride_y1, stride_dy1, stride_act, stride_dp,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, CLAMPED)
            if TAIL == 2:
                _zero_dact_rows(dy1_ptr, act_ptr, dp_ptr, (pid_m + 1) * BLOCK_M, stride_dy1,
                                stride_act, stride_dp, pid_n, ffn, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n, expert, ok = program_tile(
            tl.program_id(0), num_blocks, num_pid_n, block_expert_ptr, slot_route_ptr,
            num_routes, expert_counts_ptr, expert_starts_ptr, num_slots, GROUP_M, BLOCK_M,
            ROUTE_BLOCK, TAIL)
        if not ok:
            return
        _dact_swiglu_tile(
            pid_m, pid_n, expert, dout_ptr, w_ptr, w_desc, y1_ptr, weights_ptr,
            slot_token_ptr, slot_route_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit,
            num_tokens, num_routes, ffn, hidden, stride_dt, stride_we, stride_wk,
            stride_y1, stride_dy1, stride_act, stride_dp,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, CLAMPED)
        if TAIL == 2:
            _zero_dact_rows(dy1_ptr, act_ptr, dp_ptr, (pid_m + 1) * BLOCK_M, stride_dy1,
                            stride_act, stride_dp, pid_n, ffn, BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------------
# Launchers.


def _plan(routes: RouteList, cfg: GemmConfig, n: int, device: torch.device, use_tma: bool,
          ws_ok: bool = False):
    """(grid, live-block list buffer, constexprs, Plan) for a launch over the slot blocks x
    cdiv(n, BN) tiles. `ws_ok`: the kernel loads only through TMA, the one form Triton's
    Hopper warp specialization accepts (it asserts on the gathered pointer loads)."""
    if routes.block_m % cfg.block_m:
        raise ValueError(f"tile block_m {cfg.block_m} must divide the RouteList block_m "
                         f"{routes.block_m}")
    num_blocks = routes.num_slots // cfg.block_m
    tiles = num_blocks * triton.cdiv(n, cfg.block_n)
    persistent = cfg.persistent and tma.persistent_available()
    # The Hopper pass splits the M tile over two consumer warp groups of 64 rows.
    ws = (WARP_SPECIALIZE_ENABLED and persistent and ws_ok and cfg.warp_specialize
          and cfg.block_m >= 128 and tma.range_supports("warp_specialize"))
    # On Hopper the warp-specialization pass acts on an unflattened loop only.
    flatten = persistent and cfg.flatten and not (ws and tma.is_hopper(device))
    grid = max(1, min(tiles, tma.num_programs(device))) if persistent else tiles
    live_list = routes.block_expert  # unused by one-program-per-tile launches
    if persistent:  # each program's own list of the live M blocks and their experts
        live_list = torch.empty((grid, 2, max(num_blocks, 1)), dtype=torch.int32,
                                device=device)
    plan = Plan(use_tma, persistent, flatten, ws, grid)
    meta = dict(USE_TMA=use_tma, PERSISTENT=persistent, FLATTEN=plan.flatten,
                LIST_CHUNK=LIST_CHUNK_WS if ws else LIST_CHUNK)
    return (grid,), live_list, meta, plan


def splits_tail(routes: RouteList, cfg: GemmConfig) -> bool:
    """Whether cfg's split tail applies: its tile is the whole route block, of >= 32 rows."""
    return cfg.split_tail and cfg.block_m == routes.block_m and cfg.block_m >= 32


def tail_config(cfg: GemmConfig) -> GemmConfig:
    """The tile of the TAIL = 2 launch: half the rows, the same N and K tiles (so every
    output element sums the same K tiles in the same order), persistent where cfg is."""
    half = cfg.block_m // 2
    return cfg._replace(block_m=half, num_warps=8 if half * cfg.block_n >= 128 * 128 else 4,
                        warp_specialize=False, split_tail=False)


def _launch_split(launch, routes: RouteList, cfg: GemmConfig, grid, live_list, meta,
                  plan: Plan, num_experts: int, n: int, device: torch.device) -> Plan:
    """launch(grid, cfg, live_list, meta, tail) over the blocks -- with TAIL = 1 where cfg
    splits its tail -- then the TAIL = 2 launch of the short last blocks (the same weight
    descriptor: the tail tile keeps BN and BK): one program per (expert, column tile), or
    persistent over the listed short tails. Returns the Plan of what ran."""
    split = splits_tail(routes, cfg)
    launch(grid, cfg, live_list, meta, 1 if split else 0)
    if split:
        tcfg = tail_config(cfg)
        tgrid, tlist, tmeta, tplan = _plan(routes, tcfg, n, device, meta["USE_TMA"])
        if tplan.persistent:
            tgrid = (max(1, min(tgrid[0], num_experts * triton.cdiv(n, tcfg.block_n))),)
        else:
            tgrid = tail_grid(num_experts, n, tcfg.block_n)
        launch(tgrid, tcfg, tlist, tmeta, 2)
    return plan._replace(tail=split)


def _weight_desc(w_E: torch.Tensor, block_shape: tuple[int, int]):
    """Descriptor over w [E, R, C] seen as [E*R, C], or None where TMA cannot read it."""
    rows = tma.expert_rows(w_E)
    if rows is None or not tma.matrix_fits(rows, block_shape):
        return None
    return tma.descriptor(rows, block_shape)


def _gate_up_pair_desc(w_EFH: torch.Tensor, block_n: int, block_k: int):
    """Descriptor over w_gate_up [E, 2F, H] seen as [2E, F, H] (gate of e at 2e, up at 2e + 1)
    with [2, BN, BK] boxes, or None where TMA cannot read it or one dot cannot take 2 BN."""
    E, two_f, H = w_EFH.shape
    f, row = two_f // 2, w_EFH.stride(1)
    if 2 * block_n > 256 or w_EFH.stride(2) != 1 or (E > 1 and w_EFH.stride(0) != two_f * row):
        return None
    pairs = w_EFH.as_strided((2 * E, f, H), (f * row, row, 1))
    # Alignment, row stride and box checks: those of the same rows as one 2-D matrix.
    if not tma.matrix_fits(pairs.as_strided((2 * E * f, H), (row, 1)), (block_n, block_k)):
        return None
    return tma.descriptor(pairs, (2, block_n, block_k))


def _with_fallback(name: str, cfg: GemmConfig, device: torch.device, shape_key: tuple,
                   launch):
    """launch(cfg), or launch(pointer-path cfg) where cfg's variant failed on this GPU."""
    base = cfg._replace(tma=False, persistent=False, warp_specialize=False, split_tail=False,
                        paired=False)
    if cfg == base or device.type != "cuda" or not FALLBACK_ON_ERROR:
        return _fitted(name, cfg, shape_key, launch) if device.type == "cuda" else launch(cfg)
    key = (name, cfg, shape_key)
    if key not in _FAILED_VARIANTS:
        try:
            return launch(cfg)
        except Exception as exc:  # a compile or launch failure of the variant: see above
            lines = str(exc).strip().splitlines()
            _FAILED_VARIANTS[key] = f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
            warnings.warn(f"{name}: the {cfg.variant} variant of {tuple(cfg)[:6]} failed "
                          f"({_FAILED_VARIANTS[key]}); using the pointer path", RuntimeWarning)
    out = _fitted(name, base, shape_key, launch)
    LAST_PLAN[name] = LAST_PLAN[name]._replace(fallback=_FAILED_VARIANTS[key])
    return out


_FITTED_STAGES: dict = {}  # (name, cfg, shape_key) -> the stage count that fits


def _fitted(name: str, cfg: GemmConfig, shape_key: tuple, launch):
    """launch(cfg), with fewer pipeline stages where the GPU's shared memory cannot hold
    cfg's (the tiles are chosen for 2-byte operands; fp32 ones need twice the bytes a
    stage). The same shapes always get the same stage count, so results stay repeatable."""
    key = (name, cfg, shape_key)
    stages = _FITTED_STAGES.get(key, cfg.num_stages)
    while True:
        try:
            out = launch(cfg._replace(num_stages=stages))
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _FITTED_STAGES[key] = stages
        return out


def fc1_swiglu(x_TH, w_gate_up_EFH, topk_weights_N, routes: RouteList, y1_out, act_out,
               cfg: GemmConfig | None = None, *, bias_EF2=None, clamp=None):
    """Fill y1_out [S, 2F] and act_out [S, F] (live blocks only); see the module docstring.
    `bias_EF2` [E, 2F] ([gate | up] halves, any float dtype) is added in fp32 to the
    accumulator before Y1 is rounded; `clamp` = (alpha, limit) picks the clamped SwiGLU.
    With cfg.paired (and cfg.tma) gate and up load as one box for one dot (module docstring)."""
    num_tokens, hidden = x_TH.shape
    ffn = w_gate_up_EFH.shape[1] // 2
    cfg = cfg or fc1_config(ffn, routes.block_m, x_TH.device)
    return _with_fallback(
        "fc1", cfg, x_TH.device, (x_TH.dtype, routes.block_m, hidden, ffn),
        lambda c: _fc1_swiglu(x_TH, w_gate_up_EFH, topk_weights_N, routes, y1_out, act_out, c,
                              bias_EF2, clamp))


def _fc1_swiglu(x_TH, w_gate_up_EFH, topk_weights_N, routes, y1_out, act_out, cfg,
                bias_EF2=None, clamp=None):
    num_tokens, hidden = x_TH.shape
    ffn = w_gate_up_EFH.shape[1] // 2
    w_desc, paired = None, False
    if cfg.tma and tma.tma_available(x_TH.device):
        if cfg.paired:
            w_desc = _gate_up_pair_desc(w_gate_up_EFH, cfg.block_n, cfg.block_k)
            paired = w_desc is not None
        if w_desc is None:
            w_desc = _weight_desc(w_gate_up_EFH, (cfg.block_n, cfg.block_k))
    grid, live_list, meta, plan = _plan(routes, cfg, ffn, x_TH.device, w_desc is not None)

    def launch(grid, cfg, live_list, meta, tail):
        box = (cfg.block_m, cfg.block_n)
        y_tma = _fc1_store_tma(cfg, w_desc is not None, ffn, y1_out, act_out)
        _fc1_swiglu_kernel[grid](
            x_TH, w_gate_up_EFH, w_gate_up_EFH if w_desc is None else w_desc, topk_weights_N,
            routes.slot_token, routes.slot_route, routes.block_expert, live_list,
            routes.expert_counts, routes.expert_starts, w_gate_up_EFH.shape[0], y1_out, act_out,
            tma.descriptor(y1_out, box) if y_tma else y1_out,
            tma.descriptor(act_out, box) if y_tma else act_out,
            x_TH if bias_EF2 is None else bias_EF2, *_act_scalars(clamp),
            num_tokens, topk_weights_N.numel(), routes.num_slots, ffn, hidden,
            x_TH.stride(0), w_gate_up_EFH.stride(0), w_gate_up_EFH.stride(1), y1_out.stride(0),
            act_out.stride(0), 0 if bias_EF2 is None else bias_EF2.stride(0),
            ROUTE_BLOCK=routes.block_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k == 0,
            EVEN_N=ffn % cfg.block_n == 0, HAS_BIAS=bias_EF2 is not None,
            CLAMPED=clamp is not None, TAIL=tail, Y_TMA=y_tma, PAIRED=paired,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **meta)

    plan = plan._replace(store_tma=_fc1_store_tma(cfg, w_desc is not None, ffn, y1_out, act_out),
                         paired=paired)
    LAST_PLAN["fc1"] = _launch_split(launch, routes, cfg, grid, live_list, meta, plan,
                                     w_gate_up_EFH.shape[0], ffn, x_TH.device)
    return y1_out, act_out


def _fc1_store_tma(cfg: GemmConfig, weights_tma: bool, ffn: int, y1_out, act_out) -> bool:
    """Whether FC1 stores Y1 and A through TMA descriptors: with its TMA variant, whole
    column tiles (F % BN == 0: a gate box never reaches the up columns) and rows a
    descriptor can describe."""
    box = (cfg.block_m, cfg.block_n)
    return (FC1_TMA_STORE and weights_tma and ffn % cfg.block_n == 0
            and tma.matrix_fits(y1_out, box) and tma.matrix_fits(act_out, box))


def _act_scalars(clamp):
    """(alpha, limit) as the kernels' fp32 scalars; placeholders when not clamped (unused)."""
    return (1.0, 1.0) if clamp is None else (float(clamp[0]), float(clamp[1]))


def slot_gemm(a_SK, w_E, routes: RouteList, out, w_nk: bool, cfg: GemmConfig | None = None,
              *, bias_EN=None, topk_weights_N=None):
    """out[s] = a[s] @ w[e(s)]^T if w_nk (w [E, N, K]) else a[s] @ w[e(s)] (w [E, K, N]).
    With `bias_EN` [E, N] (FC2's b_down; needs `topk_weights_N`), out[s] += p(s) * bias[e(s)]
    in fp32 before the rounding; p(s) = topk_weights_N[slot_route[s]], 0 for padding."""
    k_dim = a_SK.shape[1]
    n = w_E.shape[1] if w_nk else w_E.shape[2]
    if bias_EN is not None and topk_weights_N is None:
        raise ValueError("slot_gemm: bias_EN needs topk_weights_N (the bias is scaled by p)")
    cfg = cfg or slot_gemm_config(n, routes.block_m, a_SK.device)
    return _with_fallback(
        "fc2" if w_nk else "dx", cfg, a_SK.device, (a_SK.dtype, routes.block_m, k_dim, n),
        lambda c: _slot_gemm(a_SK, w_E, routes, out, w_nk, c, bias_EN, topk_weights_N))


def _slot_gemm(a_SK, w_E, routes, out, w_nk, cfg, bias_EN=None, topk_weights_N=None):
    k_dim = a_SK.shape[1]
    n = w_E.shape[1] if w_nk else w_E.shape[2]
    a_desc = w_desc = None
    # w [E, K, N] tiles past K would contract the next expert's rows: TMA only for even K.
    if (cfg.tma and tma.tma_available(a_SK.device) and (w_nk or k_dim % cfg.block_k == 0)
            and tma.matrix_fits(a_SK, (cfg.block_m, cfg.block_k))):
        w_desc = _weight_desc(w_E, (cfg.block_n, cfg.block_k) if w_nk
                              else (cfg.block_k, cfg.block_n))
        if w_desc is not None:
            a_desc = tma.descriptor(a_SK, (cfg.block_m, cfg.block_k))
    use_tma = w_desc is not None
    # The bias epilogue's pointer loads would break warp specialization (TMA loads only).
    grid, live_list, meta, plan = _plan(routes, cfg, n, a_SK.device, use_tma,
                                        ws_ok=use_tma and bias_EN is None)

    def launch(grid, cfg, live_list, meta, tail):
        # The tail tile (TAIL = 2) reads A through a box half as tall; no warp specialization.
        a_box = a_desc if tail != 2 or not use_tma else \
            tma.descriptor(a_SK, (cfg.block_m, cfg.block_k))
        _slot_gemm_kernel[grid](
            a_SK, a_box if use_tma else a_SK, w_E, w_desc if use_tma else w_E, out,
            routes.block_expert, live_list, routes.expert_counts, routes.expert_starts,
            w_E.shape[0], routes.num_slots, n, k_dim,
            a_SK.stride(0), w_E.stride(0), w_E.stride(1), out.stride(0),
            a_SK if bias_EN is None else bias_EN,
            a_SK if bias_EN is None else topk_weights_N, routes.slot_route,
            routes.token_slots.numel(),  # N: the slot_route sentinel
            0 if bias_EN is None else bias_EN.stride(0),
            HAS_BIAS=bias_EN is not None, W_NK=w_nk, ROUTE_BLOCK=routes.block_m,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k_dim % cfg.block_k == 0,
            EVEN_N=n % cfg.block_n == 0, WARP_SPECIALIZE=plan.warp_specialize and tail != 2,
            TAIL=tail, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **meta)

    LAST_PLAN["fc2" if w_nk else "dx"] = _launch_split(launch, routes, cfg, grid, live_list,
                                                       meta, plan, w_E.shape[0], n, a_SK.device)
    return out


def dp_tiles(ffn: int, cfg: GemmConfig) -> int:
    """Columns of dact_swiglu's dp_part buffer."""
    return triton.cdiv(ffn, cfg.block_n)


def dact_swiglu(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes: RouteList,
                dy1_out, act_out, dp_part_out, cfg: GemmConfig | None = None, *, clamp=None):
    """Fill dy1_out [S, 2F], act_out [S, F] and dp_part_out [S, dp_tiles] fp32 (live blocks).
    `clamp` = (alpha, limit) picks the clamped SwiGLU backward. dp_part holds only the
    activation's share of d(route probability): FC2's bias term is the caller's."""
    num_tokens, hidden = dout_TH.shape
    ffn = w_down_EHF.shape[2]
    cfg = cfg or dact_config(ffn, routes.block_m, dout_TH.device)
    if dp_part_out.shape[1] != dp_tiles(ffn, cfg):
        raise ValueError(f"dp_part_out has {dp_part_out.shape[1]} columns, the tile config "
                         f"needs {dp_tiles(ffn, cfg)}")
    return _with_fallback(
        "dact", cfg, dout_TH.device, (dout_TH.dtype, routes.block_m, hidden, ffn),
        lambda c: _dact_swiglu(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes, dy1_out,
                               act_out, dp_part_out, c, clamp))


def _dact_swiglu(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes, dy1_out, act_out,
                 dp_part_out, cfg, clamp=None):
    num_tokens, hidden = dout_TH.shape
    ffn = w_down_EHF.shape[2]
    w_desc = None
    # Tiles of w_down [E, H, F] past H would contract the next expert's rows: even H only.
    if cfg.tma and tma.tma_available(dout_TH.device) and hidden % cfg.block_k == 0:
        w_desc = _weight_desc(w_down_EHF, (cfg.block_k, cfg.block_n))
    grid, live_list, meta, plan = _plan(routes, cfg, ffn, dout_TH.device, w_desc is not None)

    def launch(grid, cfg, live_list, meta, tail):
        _dact_swiglu_kernel[grid](
            dout_TH, w_down_EHF, w_down_EHF if w_desc is None else w_desc, y1_S2F,
            topk_weights_N, routes.slot_token, routes.slot_route, routes.block_expert,
            live_list, routes.expert_counts, routes.expert_starts, w_down_EHF.shape[0], dy1_out,
            act_out, dp_part_out, *_act_scalars(clamp),
            num_tokens, topk_weights_N.numel(), routes.num_slots, ffn, hidden,
            dout_TH.stride(0), w_down_EHF.stride(0), w_down_EHF.stride(1), y1_S2F.stride(0),
            dy1_out.stride(0), act_out.stride(0), dp_part_out.stride(0),
            ROUTE_BLOCK=routes.block_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k == 0,
            EVEN_N=ffn % cfg.block_n == 0, CLAMPED=clamp is not None, TAIL=tail,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **meta)

    LAST_PLAN["dact"] = _launch_split(launch, routes, cfg, grid, live_list, meta, plan,
                                      w_down_EHF.shape[0], ffn, dout_TH.device)
    return dy1_out, act_out, dp_part_out
