"""RMSNorm over the rows of a [..., D] tensor with transformers' numerics, forward and backward.

Forward, per row (the torch it replaces is `rms_norm_ref`, moegraph_cli/models/common/norm.py):
    x32 = x.float();  r = rsqrt(sum(x32^2) * inv_d + eps)         fp32, r saved for backward
    y = w * (x32 * r).to(x.dtype)                                   a torch mul: both operands
                                                                    in fp32, rounded once to
                                                                    y's dtype promote(x, w)
Backward, given dy (y's dtype; with a second gradient dy2 of the same y, dy = round_y(dy + dy2)
first, as autograd sums the gradients of a tensor with two consumers), with xc = round_x(x32 * r)
recomputed from x and r:
    dxc = round_x(round_y(dy * w))                                  mul backward, cast to xc's
    dx  = round_x(dxc * r - (sum(dxc * x32) * r^3 * inv_d) * x32)   fp32 math, rounded once
    dW  = round_w(round_y(sum over rows of round_y(dy * xc)))       fp32 partials, see below
Every rounding torch's unfused path makes is made here too, at the same point; what differs is
the order of the fp32 sums (the row sum of squares, the row dot product, dW's sum over rows),
so fp32 results agree to a few ulps, not bitwise. inv_d = fp32(1 / D), a product as torch's
CUDA `mean` forms it (its CPU one divides; the two are equal for a power-of-two D). Launches
turn fp-contraction off (`enable_fp_fusion=False`): no mul/add pair is fused into an fma.

Layout contract:
- x [..., D], last-dimension stride 1, whose leading dimensions flatten to rows with one row
  stride (a column slice of a wider buffer is fine: the columns past D are never read, so
  NaN there cannot leak); anything else is copied once to contiguous. Any row count (0 too)
  and any D up to MAX_D: a row lives in one program's registers, columns past D masked.
- weight [D] contiguous, any float dtype; y [..., D] contiguous, dtype promote(x, w).
- rstd [rows] fp32, every element written.
- dW: `rms_norm_backward` has P programs (a fixed number per device, `num_partials`) each sum
  its rows' dy * xc into one fp32 row of a [P, D] scratch, every element of which it writes
  (zeros for a program with no rows); a second kernel sums the P rows in a fixed order per
  column and rounds: no atomics, so the result is the same bits on every run and in a CUDA
  graph replay. With `dw_out` (a sink's `.grad`, grads.target) it is stored there
  (`accumulate=False`) or added to it as `grad.add_(dW)` would (fp32 sum of the old value and
  the rounded dW, rounded once); otherwise a new [D] tensor in w's dtype is returned.
- Nothing here syncs with the host or allocates a data-dependent size: capturable.
"""

import functools

import torch
import triton
import triton.language as tl

from .env import ints_from_env

MAX_D = 32768
TILE_ELEMS = 4096  # elements per program tile: rows x next_power_of_2(D)
MAX_ROWS_PER_TILE = 64
PARTIALS_PER_SM = 8  # backward programs per SM on a GPU (each loops over its rows)
PARTIALS_CPU = 4  # the interpreter: a few, so each loops over several row blocks
# The dW reduction's (partial rows, columns) a program step on a GPU: narrow column blocks so
# even D = 2048 spreads over 64 programs, each summing its P = 8 x 132 partial rows in about
# four steps (a [32, 128] tile left 16 programs of 33 steps: 0.69 ms over the 17 reductions of
# the loaded 4-layer Qwen3-30B step, results/whole_step_topk_kernel.json).
# D < 1024 (the q / k head norms, D = 128) halves the columns: still 8 programs.
# MOEGRAPH_NORM_REDUCE_TILE="rows,cols" sets one tile for every D (32,128 is the tile of before).
_REDUCE_ENV = ints_from_env("MOEGRAPH_NORM_REDUCE_TILE", "rows,cols")
REDUCE_TILE = _REDUCE_ENV or (256, 32)
REDUCE_TILE_NARROW = _REDUCE_ENV or (256, 16)
# Tests set a float (NaN) to fill the dW scratch: an element a program fails to write shows.
SCRATCH_FILL: float | None = None


@triton.jit
def round_to(v, DT: tl.constexpr):
    """v (fp32) rounded to DT and back: a torch op's output rounding."""
    return v.to(DT).to(tl.float32)


@triton.jit
def _rmsnorm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, D, stride_x, eps, inv_d,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    X_DT: tl.constexpr = x_ptr.dtype.element_ty
    eps = tl.full([], eps, tl.float32)
    inv_d = tl.full([], inv_d, tl.float32)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)
    xc = round_to(x * r[:, None], X_DT)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = w[None, :] * xc
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask)
    tl.store(rstd_ptr + rows, r, mask=row_ok)


@triton.jit
def _rmsnorm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, dres_ptr, dy2_ptr,
    n_rows, D, stride_dy, stride_x, stride_dres, stride_dy2, inv_d, n_blocks,
    HAS_DW: tl.constexpr, HAS_RES: tl.constexpr, HAS_DY2: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    X_DT: tl.constexpr = x_ptr.dtype.element_ty
    Y_DT: tl.constexpr = dy_ptr.dtype.element_ty
    inv_d = tl.full([], inv_d, tl.float32)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # Program pid takes row blocks pid, pid + P, ...: a fixed assignment, a fixed sum order.
    for blk in range(pid, n_blocks, tl.num_programs(0)):
        rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        if HAS_DY2:  # y's second consumer: the sum autograd would form, rounded to y's dtype
            dy = round_to(dy + tl.load(dy2_ptr + rows64[:, None] * stride_dy2 + cols[None, :],
                                       mask=mask, other=0.0).to(tl.float32), Y_DT)
        r = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        if HAS_DW:
            xc = round_to(x * r[:, None], X_DT)
            dw_acc += tl.sum(round_to(dy * xc, Y_DT), axis=0)
        dxc = round_to(round_to(dy * w[None, :], Y_DT), X_DT)
        coef = tl.sum(dxc * x, axis=1) * (r * r * r) * inv_d
        dx = dxc * r[:, None] - coef[:, None] * x
        if HAS_RES:  # + the skip connection's gradient, as autograd's add of the two would
            dx = round_to(dx, X_DT) + tl.load(
                dres_ptr + rows64[:, None] * stride_dres + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
    if HAS_DW:
        tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw_acc, mask=col_ok)


@triton.jit
def _dw_reduce_kernel(
    part_ptr, dw_ptr, n_parts, D,
    Y_DT: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dw[c] (=, or += as grad.add_) round_w(round_y(sum_p part[p, c])), p in a fixed order."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(part_ptr + parts.to(tl.int64)[:, None] * D + cols[None, :],
                       mask=(parts < n_parts)[:, None] & col_ok[None, :], other=0.0)
    W_DT: tl.constexpr = dw_ptr.dtype.element_ty
    dw = round_to(round_to(tl.sum(acc, axis=0), Y_DT), W_DT)
    if ACCUMULATE:
        dw = tl.load(dw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + dw
    tl.store(dw_ptr + cols, dw.to(W_DT), mask=col_ok)


# -- launchers --------------------------------------------------------------------------------
def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t as [rows, D] with stride 1 in D and one row stride (a view when the strides allow)."""
    if t.dim() == 0:
        raise ValueError(f"rmsnorm: {name} must have at least one dimension")
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < t2.shape[1]):
        t2 = t2.contiguous()
    return t2


def _tile(D: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for rows of D elements."""
    if D > MAX_D:
        raise ValueError(f"rmsnorm: rows of {D} elements, more than the {MAX_D} one program "
                         f"holds")
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(TILE_ELEMS // block_d, MAX_ROWS_PER_TILE))
    elems = block_r * block_d
    return block_r, block_d, 4 if elems <= 2048 else 8 if elems <= 4096 else 16


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_partials(device: torch.device, n_blocks: int, per_sm: int | None = None) -> int:
    """Programs (= fp32 dW partial rows) of a backward over n_blocks row blocks: `per_sm`
    (default PARTIALS_PER_SM) per SM on a GPU, at most n_blocks."""
    if device.type == "cuda":
        cap = (per_sm or PARTIALS_PER_SM) * _sm_count(device.index if device.index is not None
                                          else torch.cuda.current_device())
    else:
        cap = PARTIALS_CPU
    return max(1, min(n_blocks, cap))


def scratch(shape, device) -> torch.Tensor:
    """The fp32 dW partials buffer (NaN-filled when a test sets SCRATCH_FILL)."""
    if SCRATCH_FILL is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return torch.full(shape, SCRATCH_FILL, dtype=torch.float32, device=device)


def reduce_dw(part_PD: torch.Tensor, y_dtype: torch.dtype, w_dtype: torch.dtype,
              dw_out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """dW from the fp32 partials [P, D] (contract above): into dw_out, or a new [D] tensor."""
    n_parts, D = part_PD.shape
    if dw_out is None:
        dw_out = torch.empty(D, dtype=w_dtype, device=part_PD.device)
        accumulate = False
    if dw_out.shape != (D,) or not dw_out.is_contiguous() or dw_out.dtype != w_dtype:
        raise ValueError(f"rmsnorm: the weight gradient buffer is {dw_out.dtype} "
                         f"{list(dw_out.shape)}, the weight {w_dtype} [{D}] contiguous")
    block_p, block_d = (32, 128) if not part_PD.is_cuda else \
        REDUCE_TILE if D >= 1024 else REDUCE_TILE_NARROW
    _dw_reduce_kernel[(triton.cdiv(D, block_d),)](
        part_PD, dw_out, n_parts, D, Y_DT=_tl_dtype(y_dtype), ACCUMULATE=accumulate,
        BLOCK_P=block_p, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False)
    return dw_out


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16}[dtype]


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [..., D] contiguous in promote(x, w) dtype, rstd [rows] fp32); see the docstring."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rmsnorm: weight has shape {list(weight.shape)}, rows have {D} "
                         f"elements")
    x2 = _rows(x, "x")
    n_rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0 or D == 0:
        return y, rstd
    block_r, block_d, warps = _tile(D)
    _rmsnorm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
        x2, weight.contiguous(), y, rstd, n_rows, D, x2.stride(0), float(eps), 1.0 / D,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, enable_fp_fusion=False)
    return y, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor, need_dw: bool = True,
                      dw_out: torch.Tensor | None = None, accumulate: bool = False,
                      dres: torch.Tensor | None = None, dy2: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx [..., D] contiguous in x's dtype, dW or None). dW goes into dw_out when given
    (written, or added with `accumulate`) and is then returned as None; see the docstring.
    `dres` (x's shape and dtype): the gradient of a skip connection that also reads x, added
    to dx as autograd adds two gradients (dx rounded to x's dtype first, one fp32 sum).
    `dy2` (dy's shape and dtype): a second gradient of y, from y's second consumer, summed
    with dy as autograd sums the two (one fp32 sum rounded to y's dtype) before anything
    else reads dy."""
    D = x.shape[-1]
    x2, dy_rows = _rows(x, "x"), _rows(dy, "dy")
    n_rows = x2.shape[0]
    if dy_rows.shape != x2.shape:
        raise ValueError(f"rmsnorm: dy has shape {list(dy.shape)}, x {list(x.shape)}")
    res2 = None if dres is None else _rows(dres, "dres")
    if res2 is not None and (res2.shape != x2.shape or dres.dtype != x.dtype):
        raise ValueError(f"rmsnorm: dres is {dres.dtype} {list(dres.shape)}, x {x.dtype} "
                         f"{list(x.shape)}")
    dy2_rows = None if dy2 is None else _rows(dy2, "dy2")
    if dy2_rows is not None and (dy2_rows.shape != x2.shape or dy2.dtype != dy.dtype):
        raise ValueError(f"rmsnorm: dy2 is {dy2.dtype} {list(dy2.shape)}, dy {dy.dtype} "
                         f"{list(dy.shape)}")
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0 or D == 0:
        dx.zero_()
        if not need_dw:
            return dx, None
        if dw_out is None:
            return dx, torch.zeros(D, dtype=weight.dtype, device=x.device)
        if not accumulate:
            dw_out.zero_()
        return dx, None
    block_r, block_d, warps = _tile(D)
    n_blocks = triton.cdiv(n_rows, block_r)
    n_parts = num_partials(x.device, n_blocks)
    part = scratch((n_parts, D), x.device) if need_dw else rstd  # rstd: an unused pointer
    _rmsnorm_bwd_kernel[(n_parts,)](
        dy_rows, x2, weight.contiguous(), rstd, dx, part, dy_rows if res2 is None else res2,
        dy_rows if dy2_rows is None else dy2_rows, n_rows, D, dy_rows.stride(0), x2.stride(0),
        0 if res2 is None else res2.stride(0), 0 if dy2_rows is None else dy2_rows.stride(0),
        1.0 / D, n_blocks, HAS_DW=need_dw, HAS_RES=res2 is not None,
        HAS_DY2=dy2_rows is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
        enable_fp_fusion=False)
    if not need_dw:
        return dx, None
    dw = reduce_dw(part, dy.dtype, weight.dtype, dw_out, accumulate)
    return dx, (None if dw_out is not None else dw)


# -- pure-torch reference ---------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The unfused torch math (norm.py's CPU path), differentiable by autograd."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
