"""Host-side launch machinery shared by fc1_swiglu.py, slot_gemm.py and dact_swiglu.py.

- `build_plan`: what a launch over the slot blocks x cdiv(n, BN) column tiles runs of the
  requested GemmConfig variant (gemm_config.py) on this device: the grid, the persistent
  programs' live-block list scratch [grid, 2, S / BLOCK_M] int32, the variant constexprs,
  and the `Plan` of what was kept.
- `launch_split`: the launch, and where the config splits its tail, the second (TAIL = 2)
  launch of half-height tiles over the experts' short last blocks (slot_schedule.py).
- `with_fallback`: on a GPU, a variant whose kernel fails to compile or launch is remembered
  (`_FAILED_VARIANTS`), warned about once and replaced by the pointer path (unless
  `FALLBACK_ON_ERROR` is False); `fitted` lowers the pipeline stages where shared memory
  cannot hold the config's, for a variant before it falls back and for the pointer path.
- `LAST_PLAN`: the Plan of the latest launch of each kernel, for tests and benchmarks.
Tests and benchmarks set this module's state (FALLBACK_ON_ERROR, LAST_PLAN, _FAILED_VARIANTS,
tail_grid) and the flags of gemm_config.py: the kernel modules read them at call time, as
`gemm_launch.NAME` / `gemm_config.NAME`, never as copies.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from . import gemm_config as gc
from . import tma
from .gemm_config import GemmConfig, splits_tail, tail_config
from .route_align import RouteList
from .slot_schedule import tail_grid


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
    paired: bool = False  # FC1: gate and up as one [2, BN, BK] box, one dot; dact: a
    # [BM, 2 BN] tile, its epilogue in BN / 2 quarters


# The plan of the latest launch of each kernel ("fc1", "fc2"/"dx" by w_nk, "dact"), for tests
# and benchmarks that must know whether a variant fell back.
LAST_PLAN: dict[str, Plan] = {}

# On a GPU, a variant whose kernel fails to compile or launch (a Triton without a pass this
# kernel needs, shared memory over the limit) is remembered, warned about once and replaced by
# the pointer path (a Gluon kernel by its Triton one: gluon_launch). Benchmarks set this False
# to see the error instead.
FALLBACK_ON_ERROR = True
_FAILED_VARIANTS: dict[tuple, str] = {}  # what failed -> _failure's line


def build_plan(routes: RouteList, cfg: GemmConfig, n: int, device: torch.device,
               use_tma: bool, ws_ok: bool = False):
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
    ws = (gc.WARP_SPECIALIZE_ENABLED and persistent and ws_ok and cfg.warp_specialize
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
                LIST_CHUNK=gc.LIST_CHUNK_WS if ws else gc.LIST_CHUNK)
    return (grid,), live_list, meta, plan


def launch_split(launch, routes: RouteList, cfg: GemmConfig, grid, live_list, meta,
                 plan: Plan, num_experts: int, n: int, device: torch.device) -> Plan:
    """launch(grid, cfg, live_list, meta, tail) over the blocks -- with TAIL = 1 where cfg
    splits its tail -- then the TAIL = 2 launch of the short last blocks (the same weight
    descriptor: the tail tile keeps BN and BK): one program per (expert, column tile), or
    persistent over the listed short tails. Returns the Plan of what ran."""
    split = splits_tail(routes, cfg)
    launch(grid, cfg, live_list, meta, 1 if split else 0)
    if split:
        tcfg = tail_config(cfg)
        tgrid, tlist, tmeta, tplan = build_plan(routes, tcfg, n, device, meta["USE_TMA"])
        if tplan.persistent:
            tgrid = (max(1, min(tgrid[0], num_experts * triton.cdiv(n, tcfg.block_n))),)
        else:
            tgrid = tail_grid(num_experts, n, tcfg.block_n)
        launch(tgrid, tcfg, tlist, tmeta, 2)
    return plan._replace(tail=split)


def with_fallback(name: str, cfg: GemmConfig, device: torch.device, shape_key: tuple,
                  launch, keep: tuple[str, ...] = ()):
    """launch(cfg), or launch(pointer-path cfg) where cfg's variant failed on this GPU. `keep`
    names GemmConfig fields the pointer path keeps from cfg (ones that shape the outputs)."""
    base = cfg._replace(tma=False, persistent=False, warp_specialize=False, split_tail=False,
                        paired=False)
    base = base._replace(**{f: getattr(cfg, f) for f in keep})
    if cfg == base or device.type != "cuda" or not FALLBACK_ON_ERROR:
        return fitted(name, cfg, shape_key, launch) if device.type == "cuda" else launch(cfg)
    key = (name, cfg, shape_key)
    if key not in _FAILED_VARIANTS:
        try:
            # Shared memory over the limit (fp32 operands: twice a stage's bytes) first costs
            # the variant pipeline stages, as it does the pointer path.
            return fitted(name, cfg, shape_key, launch)
        except Exception as exc:  # a compile or launch failure of the variant: see above
            _FAILED_VARIANTS[key] = _failure(exc)
            warnings.warn(f"{name}: the {cfg.variant} variant of {tuple(cfg)[:6]} failed "
                          f"({_FAILED_VARIANTS[key]}); using the pointer path", RuntimeWarning)
    out = fitted(name, base, shape_key, launch)
    LAST_PLAN[name] = LAST_PLAN[name]._replace(fallback=_FAILED_VARIANTS[key])
    return out


_FITTED_STAGES: dict = {}  # (name, cfg, shape_key) -> the stage count that fits


def fitted(name: str, cfg: GemmConfig, shape_key: tuple, launch):
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


def act_scalars(clamp):
    """(alpha, limit) as the kernels' fp32 scalars; placeholders when not clamped (unused)."""
    return (1.0, 1.0) if clamp is None else (float(clamp[0]), float(clamp[1]))


def _failure(exc: Exception) -> str:
    """A failed launch, in one line: its type and its message's first line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def gluon_launch(name: str, key: tuple, launch, record: dict | None = None) -> bool:
    """launch() of a warp-specialized Gluon kernel (wgrad_ws.py, slot_gemm_ws.py,
    fc1_swiglu_ws.py), and True; False where it failed before for this key, or fails now (a
    compile failure on this GPU or Triton: warned once, remembered with the failed variants,
    and the caller runs its Triton kernel instead). With FALLBACK_ON_ERROR off the failure is
    raised. `record`: LAST_PLAN[name] becomes the persistent, TMA, warp-specialized Plan of
    the grid launch() returns, with these further fields."""
    key = ("gluon", name, key)
    if key in _FAILED_VARIANTS:
        return False
    try:
        grid = launch()
    except Exception as exc:  # see above
        if not FALLBACK_ON_ERROR:
            raise
        _FAILED_VARIANTS[key] = _failure(exc)
        warnings.warn(f"{name}: the warp-specialized kernel failed ({_FAILED_VARIANTS[key]}); "
                      "using the Triton kernel", RuntimeWarning)
        return False
    if record is not None:
        LAST_PLAN[name] = Plan(tma=True, persistent=True, flatten=False, warp_specialize=True,
                               grid=grid, **record)
    return True
