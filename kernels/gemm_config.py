"""Tile configs and variants of the slot GEMMs (fc1_swiglu.py, slot_gemm.py, dact_swiglu.py).

Slot GEMMs: per-expert GEMMs over the RouteList's slot blocks, gathers riding the A-tile load.
Layout contract shared by the three kernels (S slots, BM-blocks of one expert each, see
route_align.py; T tokens, H hidden, F ffn width, E experts; all tensors row-major with a
contiguous last dimension); each kernel's own contract is in its module's docstring.
Sentinel and padding rules: a padding slot (slot_token == T, slot_route == T*k) reads its
gathered row as zeros through the load mask (never a real row) and its probability as 0, so
every row of a live block is written with finite values (zeros for padding slots). Blocks with
block_expert == -1 exit at once: their rows are never written and never read by anything that
feeds a real result. Row index * row stride is formed in int64.
Tile configs are picked on the host from static shapes (no autotune: the kernels are captured
in CUDA graphs); BLOCK_M must divide the RouteList's block_m.

Variants (GemmConfig fields; each falls back to the pointer path where it cannot run, see
tma.py and gemm_launch.py; the default is the pointer path with one program per tile):
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
- `warp_specialize` (block_m 128): on a Hopper GPU, the warp-specialized Gluon kernel of
  slot_gemm (slot_gemm_ws.py) or of fc1_swiglu (fc1_swiglu_ws.py) where the launch fits;
  else, in slot_gemm (persistent + tma), passed to that tl.range (where
  WARP_SPECIALIZE_ENABLED).
  On Hopper (Triton 3.6) the pass splits a loop whose loads are all TMA into a producer warp
  group and two consumer warp groups of 64 rows (num_warps=4 -> 12 warps), and only when the
  loop is not flattened, so flatten is dropped there. The gathered kernels ignore it: the pass
  asserts on their pointer loads. wgrad reads it as its own switch: the warp-specialized Gluon
  kernel (wgrad_ws.py), whose producer gathers rows by cp.async, on a Hopper GPU.
- `split_tail` (where the tile is the whole route block): two launches, the second running
  each expert's last block, when it holds at most block_m / 2 real rows, as a half-height tile
  (`slot_schedule.py`; about 5.6% of the FC1 / FC2 work at 512 uniform routes per expert).
  Its tile keeps BN, BK and the K order, so each output element sums the same terms in the
  same order; the half-height MMA is the only change (bitwise equal on the H200). Off in the
  product: on the H200 the second launch cost more than it saved, at every tail tile tried
  (benchmarks/experts_ab.py; benchmarks/results/NOTES.md, "padding, FC1 stores and the
  sustained-load ceiling", 2026-11-30).
- `paired` (fc1_swiglu with `tma`, 2 BN <= 256): gate and up as one weight box; see
  fc1_swiglu.py. In dact_swiglu (where 2 BN divides F): a [BM, 2 BN] tile, one dot a K
  step, its epilogue in BN / 2 quarters; see dact_swiglu.py.
- `fast_act` (default on; the variant part `exact` turns it off): fc1_swiglu's and
  dact_swiglu's gated activation without the range fix-ups of Triton's fp32 exp and division
  (gated_act.py, FAST): bitwise the plain path for gate inputs >= -87.33. CPU launches ignore
  it (the interpreter has no inline assembly).
Every variant computes each output tile with the default's tile shape and K order, so on a GPU
its results are bitwise equal to the default path's (the cuda tests check it); dact's paired
tile writes dp_part in quarter columns, which sum in other groups (its dY1 and A are
bitwise). In the interpreter too, except the transposed TMA weight tile of fc1 / fc2, which
numpy's matmul sums in another order (equal to 1e-6), and the split tail's half-height tiles
(likewise).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .env import flag_from_env, ints_from_env
from .fp_fusion import FUSED
from .route_align import RouteList

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

# dA at 128-row blocks as the paired 128 x 256 tile (GemmConfig.paired, dact_swiglu.py), 3
# stages: the product's choice in moe/experts.tile_configs unless MOEGRAPH_DACT_PAIRED=0.
DACT_PAIRED = flag_from_env("MOEGRAPH_DACT_PAIRED", True)

# Off: on the H200 with Triton 3.6 (2026-11-30) the warp-specialized persistent TMA slot_gemm
# compiled but its first launch failed with "operation not supported on global/shared address
# space" and lost the CUDA context (not recoverable, so no fallback can catch it). A config
# asking for it runs the persistent TMA kernel without warp specialization.
WARP_SPECIALIZE_ENABLED = False

# FC2 and dX at 128-row blocks ask for the warp-specialized Gluon kernel of slot_gemm_ws.py
# (`GemmConfig.warp_specialize`, which slot_gemm reads as that kernel's switch: taken on a
# Hopper GPU where the launch fits, the Triton kernel otherwise; the same sums). H100
# (benchmarks/kernel_sweep.py, Qwen3 shape, uniform / skewed, results/kernel_sweep_slot_ws_h100
# .json), ms against the persistent TMA Triton kernel: FC2 0.425 / 0.440 -> 0.407 / 0.404 at
# T = 8192, 1.569 / 1.560 -> 1.354 / 1.361 at 32768; dX 0.798 / 0.765 -> 0.769 / 0.760 and
# 2.691 / 2.703 -> 2.512 / 2.538. MOEGRAPH_SLOT_GEMM_WS=0 keeps the Triton kernel.
SLOT_GEMM_WS = flag_from_env("MOEGRAPH_SLOT_GEMM_WS", True)

# MOEGRAPH_FC1_WS=1: FC1 at 128-row blocks asks for the warp-specialized Gluon kernel of
# fc1_swiglu_ws.py the same way (its X rows gathered by cp.async in a producer partition, its
# SwiGLU epilogue in a partition of its own). Off: on the H100 (benchmarks/kernel_sweep.py,
# Qwen3 shape, uniform / skewed, results/kernel_sweep_fc1_epi_h100.json) FC1 alone ran 0.856 /
# 0.865 ms against the Triton kernel's 0.848 / 0.866 at T = 8192 and 2.823 / 2.849 against
# 2.949 / 2.987 at 32768, bitwise the same; the whole expert fwd+bwd and the loaded step moved
# inside their resolution (tiles_ab_fc1_epi_h100.json, whole_step_loaded_fc1_ws_*_h100.json).
FC1_WS = flag_from_env("MOEGRAPH_FC1_WS", False)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # Variants of fc1_swiglu / slot_gemm / dact_swiglu (see the module docstring); wgrad
    # reads tma, persistent, warp_specialize and store_tma (wgrad.py). Defaults keep the
    # pointer path, one program per tile.
    tma: bool = False
    persistent: bool = False
    flatten: bool = True  # persistent only
    warp_specialize: bool = False  # persistent only
    # Where block_m is the route block: leave each expert's last block, when it holds at most
    # block_m / 2 real rows, to a second launch of block_m / 2-row tiles (slot_schedule.py).
    split_tail: bool = False
    # fc1_swiglu with TMA: gate and up weight tiles as one [2, BN, BK] box of w_gate_up seen
    # as [2E, F, H], one [BM, 2BN] dot a K step (2 * BN <= 256). dact_swiglu: a [BM, 2BN]
    # tile, its epilogue in BN / 2 quarters. Other kernels ignore it.
    paired: bool = False
    # A register cap a thread (ptxas .maxnreg, Triton's `maxnreg`): at 128, two 8-warp CTAs
    # fit an SM's 64 K registers where their shared memory fits too. None: ptxas decides.
    maxnreg: int | None = None
    # wgrad: the dW tile leaves by a TMA bulk store (kernels/wgrad.py). Others ignore it.
    store_tma: bool = False
    # fc1_swiglu / dact_swiglu on a GPU: the gated activation's exp and reciprocal without
    # Triton's range fix-ups (gated_act.py, FAST: the same bits for gate inputs >= -87.33).
    # False (variant part `exact`) keeps Triton's exp and division. Others ignore it.
    fast_act: bool = True

    def launch_options(self) -> dict:
        """The launch keywords of the tile: warps, stages, contraction (fp_fusion.py), and
        the register cap if set."""
        out = {"num_warps": self.num_warps, "num_stages": self.num_stages,
               "enable_fp_fusion": FUSED}
        if self.maxnreg is not None:
            out["maxnreg"] = self.maxnreg
        return out

    @property
    def variant(self) -> str:
        """Short name: 'base', 'tma', 'persistent', 'tma+persistent', '+ws', '+noflat', '+tail',
        '+pair', '+rN', '+store', '+exact'."""
        parts = (["tma"] if self.tma else []) + (["persistent"] if self.persistent else [])
        if self.persistent and self.warp_specialize:
            parts.append("ws")
        if self.persistent and not self.flatten:
            parts.append("noflat")
        if self.split_tail:
            parts.append("tail")
        if self.paired:
            parts.append("pair")
        if self.maxnreg is not None:
            parts.append(f"r{self.maxnreg}")
        if self.store_tma:
            parts.append("store")
        if not self.fast_act:
            parts.append("exact")
        return "+".join(parts) or "base"

    def with_variant(self, name: str) -> GemmConfig:
        """This tile under the variant `name` ('base', 'tma', 'tma+persistent+ws', ...: the
        `variant` property's spelling)."""
        parts = set(name.split("+")) - {"base"}
        caps = {p for p in parts if p[:1] == "r" and p[1:].isdigit()}
        unknown = parts - caps - {"tma", "persistent", "ws", "noflat", "tail", "pair", "store",
                                  "exact"}
        if unknown or len(caps) > 1:
            bad = sorted(unknown)[0] if unknown else sorted(caps)[1]
            raise ValueError(f"GemmConfig: unknown variant part {bad!r} in {name!r}; parts "
                             "are tma, persistent, ws, noflat, tail, pair, store, exact and "
                             "one rN (a register cap)")
        return self._replace(tma="tma" in parts, persistent="persistent" in parts,
                             warp_specialize="ws" in parts, flatten="noflat" not in parts,
                             split_tail="tail" in parts, paired="pair" in parts,
                             maxnreg=int(next(iter(caps))[1:]) if caps else None,
                             store_tma="store" in parts, fast_act="exact" not in parts)


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


def splits_tail(routes: RouteList, cfg: GemmConfig) -> bool:
    """Whether cfg's split tail applies: its tile is the whole route block, of >= 32 rows."""
    return cfg.split_tail and cfg.block_m == routes.block_m and cfg.block_m >= 32


def tail_config(cfg: GemmConfig) -> GemmConfig:
    """The tile of the TAIL = 2 launch: half the rows, the same N and K tiles (so every
    output element sums the same K tiles in the same order), persistent where cfg is."""
    half = cfg.block_m // 2
    return cfg._replace(block_m=half, num_warps=8 if half * cfg.block_n >= 128 * 128 else 4,
                        warp_specialize=False, split_tail=False)
