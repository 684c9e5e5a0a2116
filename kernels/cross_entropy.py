"""Cross-entropy over rows of logits, fp32 math, no fp32 [T, V] buffer.

Forward, per row t:   lse[t] = log sum_v exp(logits[t, v])     (online, one pass over V)
                      loss[t] = lse[t] - logits[t, labels[t]]
Backward, per element: dlogits[t, v] = (exp(logits[t, v] - lse[t]) - [v == labels[t]]) * scale
                       scale = grad_loss / n_valid

Layout contract:
- logits [T, V] in bf16, fp16 or fp32, row-major with a contiguous last dimension; the row
  stride may exceed V (a padded allocation): columns V.. of a row are never read or written.
  V need not be a multiple of the block: the last block of a row is masked. Row * row stride is
  formed in int64 (T * V passes 2**31 at T = 14k for Qwen3's V = 151936).
- labels [T], int32 or int64. A row whose label == ignore_index is *ignored*: its logits are
  never read (they may hold NaN), lse[t] = loss[t] = 0 and its dlogits row is written zeros.
  A label outside [0, V) that is not ignore_index is not checked (no host sync): it gives
  loss[t] = NaN, so the mean loss shows it, and no one-hot term in the backward.
- lse [T] and loss [T] fp32, every element written. The mean over kept rows is the caller's:
  sum(loss) / n_valid (see moegraph_cli/models/common/loss.py).
- grad_loss (0-d or [1], any float dtype) and n_valid (0-d or [1], the number of kept rows,
  any dtype) are read from the device inside the backward kernel, so neither pass syncs with
  the host and both can be captured in a CUDA graph. n_valid == 0 leaves only ignored rows:
  every dlogits element is zero, as torch gives.
- dlogits [T, V] in its own dtype (usually the logits'), contiguous last dimension, any row
  stride; it may be the logits buffer itself (in place: each element is read, then written, by
  the same program). Every element of columns [0, V) is written.

The `*_ref` functions are the same contract in pure torch, computed a chunk of rows at a time
so no more than `REF_CHUNK_ELEMS` fp32 elements of logits exist at once: the CPU path and the
tests' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp_fusion import FUSED

REF_CHUNK_ELEMS = 1 << 22  # 16 MB of fp32 per row chunk in the pure-torch path
# The forward on a GPU, rows longer than FWD_CHUNK: FWD_CHUNK columns a program, FWD_CHUNK_BLOCK
# columns a step at FWD_CHUNK_WARPS warps. H200, logits [16384, 151936] bf16
# (benchmarks/elementwise_ab.py, results/elementwise_ab.json): 1.244 ms against 1.470 one
# program a row (twin 1.019); 49152 or 77824 columns 1.012 / 1.017, 4096-column steps 1.077.
FWD_CHUNK, FWD_CHUNK_BLOCK, FWD_CHUNK_WARPS = 65536, 2048, 2


def _block_v(vocab: int, device: torch.device, cap: int) -> int:
    return min(triton.next_power_of_2(vocab), cap if device.type == "cuda" else 4096)


@triton.jit
def _online_max_sum(row_ptr, lo, hi, BLOCK_V: tl.constexpr):
    """(m, d) of the columns [lo, hi) of one row: m their max, d the sum of exp(x - m).
    Online: a running scalar max and per-lane sums rescaled to it, so each block costs one
    cross-lane reduction (the max); the lanes are summed once at the end."""
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_V):
        x = tl.load(row_ptr + start + cols, mask=start + cols < hi,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    return m, tl.sum(d, axis=0)


@triton.jit
def _ce_fwd_kernel(
    logits_ptr, labels_ptr, lse_ptr, loss_ptr,
    V, stride_row, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    m, d = _online_max_sum(row_ptr, 0, tl.where(valid, V, 0), BLOCK_V)  # ignored: no read
    lse = m + tl.log(tl.where(valid, d, 1.0))  # the sum is >= 1 if valid
    in_range = (label >= 0) & (label < V)
    x_label = tl.load(row_ptr + label, mask=valid & in_range,
                      other=float("nan")).to(tl.float32)
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
    tl.store(loss_ptr + row, tl.where(valid, lse - x_label, 0.0))


@triton.jit
def _ce_fwd_chunk_kernel(
    logits_ptr, labels_ptr, part_ptr, V, stride_row, ignore_index, CHUNK,
    BLOCK_V: tl.constexpr,
):
    """Program (row, c): the max m and the sum d of exp(x - m) over the row's columns
    [c * CHUNK, (c + 1) * CHUNK), online as _ce_fwd_kernel, into part[row, c] = (m, d)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lo = chunk * CHUNK
    m, d = _online_max_sum(row_ptr, lo, tl.where(valid, tl.minimum(lo + CHUNK, V), lo),
                           BLOCK_V)  # an ignored row reads nothing
    out = part_ptr + (row.to(tl.int64) * tl.num_programs(1) + chunk) * 2
    tl.store(out, m)
    tl.store(out + 1, d)


@triton.jit
def _ce_fwd_combine_kernel(
    logits_ptr, labels_ptr, part_ptr, lse_ptr, loss_ptr, n_rows, V, stride_row,
    ignore_index, NUM_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """lse and loss of BLOCK_R rows from their chunks' (m, d): lse = M + log(sum_c d_c *
    exp(m_c - M)), M = max_c m_c, the chunks summed in one fixed order."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    label = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (label != ignore_index)
    c = tl.arange(0, BLOCK_C)
    at = part_ptr + (rows.to(tl.int64) * NUM_CHUNKS)[:, None] * 2 + c[None, :] * 2
    mask = valid[:, None] & (c[None, :] < NUM_CHUNKS)
    m = tl.load(at, mask=mask, other=float("-inf"))
    d = tl.load(at + 1, mask=mask, other=0.0)
    big = tl.max(m, axis=1)
    big = tl.where(valid, big, 0.0)
    s = tl.sum(tl.where(mask, d * tl.exp(m - big[:, None]), 0.0), axis=1)
    lse = big + tl.log(tl.where(valid, s, 1.0))  # the sum is >= 1 if valid
    in_range = (label >= 0) & (label < V)
    x_label = tl.load(logits_ptr + rows.to(tl.int64) * stride_row + label,
                      mask=valid & in_range, other=float("nan")).to(tl.float32)
    tl.store(lse_ptr + rows, tl.where(valid, lse, 0.0), mask=row_ok)
    tl.store(loss_ptr + rows, tl.where(valid, lse - x_label, 0.0), mask=row_ok)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr, dlogits_ptr, labels_ptr, lse_ptr, grad_loss_ptr, n_valid_ptr,
    V, stride_row, stride_drow, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    n_cols = tl.where(valid, V, 0)  # an ignored row reads nothing
    # n_valid == 0 leaves only ignored rows, which never use the scale.
    scale = tl.load(grad_loss_ptr).to(tl.float32) / tl.maximum(
        tl.load(n_valid_ptr).to(tl.float32), 1.0)
    lse = tl.load(lse_ptr + row)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < n_cols,
                other=0.0).to(tl.float32)
    g = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * scale
    g = tl.where(valid, g, 0.0)
    tl.store(dlogits_ptr + row.to(tl.int64) * stride_drow + cols,
             g.to(dlogits_ptr.dtype.element_ty), mask=col_ok)


def _check_rows(name: str, rows_TV: torch.Tensor, labels_T: torch.Tensor) -> None:
    if rows_TV.dim() != 2 or rows_TV.stride(1) != 1 or rows_TV.stride(0) < rows_TV.shape[1]:
        raise ValueError(f"cross_entropy: {name} must be [T, V] with a contiguous last "
                         f"dimension, got shape {list(rows_TV.shape)} strides "
                         f"{list(rows_TV.stride())}")
    if labels_T.shape != rows_TV.shape[:1]:
        raise ValueError(f"cross_entropy: labels has shape {list(labels_T.shape)}, {name} has "
                         f"{rows_TV.shape[0]} rows")


def cross_entropy_forward(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                          ignore_index: int = -100, block_v: int | None = None,
                          chunk: int | None = None, num_warps: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [T] fp32, loss [T] fp32) of the rows of logits_TV; see the module docstring.
    `chunk` (columns, a multiple of the block) splits each row over cdiv(V, chunk) programs
    whose (max, sum) pairs a second kernel combines (`_ce_fwd_chunk_kernel`): more loads in
    flight than one program a row; lse then differs from the one-program value in its last
    bits (another summation order), deterministic at any one chunk. On a GPU rows longer
    than FWD_CHUNK take it by default; `chunk` >= V keeps one program a row."""
    _check_rows("logits", logits_TV, labels_T)
    num_rows, vocab = logits_TV.shape
    labels_T = labels_T.contiguous()
    lse_T = torch.empty(num_rows, dtype=torch.float32, device=logits_TV.device)
    loss_T = torch.empty(num_rows, dtype=torch.float32, device=logits_TV.device)
    if num_rows == 0:
        return lse_T, loss_T
    # One program streams one row. H200, T = 1024, V = 151936 bf16 (benchmarks/loss.py
    # --sweep): 8192 x 8 warps 0.093 ms (3.3 TB/s); 2048 x 8 0.142; 16384 x 8 0.136.
    if chunk is None and logits_TV.is_cuda and vocab > FWD_CHUNK:
        chunk, block_v = FWD_CHUNK, block_v or FWD_CHUNK_BLOCK
        num_warps = num_warps or FWD_CHUNK_WARPS
    block = block_v or _block_v(vocab, logits_TV.device, 8192)
    warps = num_warps or (8 if block >= 2048 else 4)
    if chunk is None or chunk >= vocab:
        _ce_fwd_kernel[(num_rows,)](
            logits_TV, labels_T, lse_T, loss_T, vocab, logits_TV.stride(0), ignore_index,
            BLOCK_V=block, num_warps=warps, enable_fp_fusion=FUSED)
        return lse_T, loss_T
    if chunk % block:
        raise ValueError(f"cross_entropy: chunk {chunk} is not a multiple of the block {block}")
    num_chunks = triton.cdiv(vocab, chunk)
    part = torch.empty((num_rows, num_chunks, 2), dtype=torch.float32,
                       device=logits_TV.device)
    _ce_fwd_chunk_kernel[(num_rows, num_chunks)](
        logits_TV, labels_T, part, vocab, logits_TV.stride(0), ignore_index, chunk,
        BLOCK_V=block, num_warps=warps, enable_fp_fusion=FUSED)
    block_r = 64
    _ce_fwd_combine_kernel[(triton.cdiv(num_rows, block_r),)](
        logits_TV, labels_T, part, lse_T, loss_T, num_rows, vocab, logits_TV.stride(0),
        ignore_index, NUM_CHUNKS=num_chunks, BLOCK_R=block_r,
        BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=4,
        enable_fp_fusion=FUSED)
    return lse_T, loss_T


def cross_entropy_backward(logits_TV: torch.Tensor, labels_T: torch.Tensor, lse_T: torch.Tensor,
                           grad_loss: torch.Tensor, n_valid: torch.Tensor,
                           ignore_index: int = -100, out_TV: torch.Tensor | None = None,
                           block_v: int | None = None, num_warps: int | None = None
                           ) -> torch.Tensor:
    """dlogits [T, V] into out_TV (a new buffer in logits' dtype when None; logits_TV itself
    for in place) and return it; see the module docstring."""
    _check_rows("logits", logits_TV, labels_T)
    num_rows, vocab = logits_TV.shape
    if out_TV is None:
        out_TV = torch.empty_like(logits_TV, memory_format=torch.contiguous_format)
    _check_rows("dlogits", out_TV, labels_T)
    if out_TV.shape != logits_TV.shape:
        raise ValueError(f"cross_entropy: dlogits has shape {list(out_TV.shape)}, logits "
                         f"{list(logits_TV.shape)}")
    if num_rows == 0:
        return out_TV
    # H200, [16384, 151936] bf16 (results/elementwise_ab_ce_bwd.json): 2048 columns at 4
    # warps 2.534 ms, 0.976 of 4096 at 8 (twin 1.000); 8192 at 8 0.997, 16384 at 16 1.043.
    block = block_v or _block_v(vocab, logits_TV.device, 2048)
    grid = (num_rows, triton.cdiv(vocab, block))
    _ce_bwd_kernel[grid](
        logits_TV, out_TV, labels_T.contiguous(), lse_T, grad_loss, n_valid,
        vocab, logits_TV.stride(0), out_TV.stride(0), ignore_index,
        BLOCK_V=block, num_warps=num_warps or (8 if block > 2048 else 4),
        enable_fp_fusion=FUSED)
    return out_TV


# -- pure-torch reference -------------------------------------------------------------------
def _ref_rows(num_rows: int, vocab: int):
    step = max(1, REF_CHUNK_ELEMS // max(vocab, 1))
    for r0 in range(0, num_rows, step):
        yield slice(r0, min(r0 + step, num_rows))


def _label_terms(labels_T: torch.Tensor, vocab: int, ignore_index: int):
    """(valid [T] bool, label in [0, V) [T] bool, a safe gather index [T])."""
    valid = labels_T != ignore_index
    in_range = valid & (labels_T >= 0) & (labels_T < vocab)
    return valid, in_range, torch.where(in_range, labels_T, 0).long()


def cross_entropy_forward_ref(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                              ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_forward in torch, fp32, one chunk of rows at a time."""
    num_rows, vocab = logits_TV.shape
    labels_T = labels_T.to(logits_TV.device)
    lse_T = torch.empty(num_rows, dtype=torch.float32, device=logits_TV.device)
    loss_T = torch.empty_like(lse_T)
    valid, in_range, index = _label_terms(labels_T, vocab, ignore_index)
    for rows in _ref_rows(num_rows, vocab):
        x = logits_TV[rows].float()
        lse = torch.logsumexp(x, dim=-1)
        x_label = torch.where(in_range[rows], x.gather(1, index[rows, None])[:, 0], torch.nan)
        lse_T[rows] = torch.where(valid[rows], lse, 0.0)
        loss_T[rows] = torch.where(valid[rows], lse - x_label, 0.0)
    return lse_T, loss_T


def cross_entropy_backward_ref(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                               lse_T: torch.Tensor, grad_loss: torch.Tensor,
                               n_valid: torch.Tensor, ignore_index: int = -100,
                               out_TV: torch.Tensor | None = None) -> torch.Tensor:
    """cross_entropy_backward in torch, fp32, one chunk of rows at a time (no host sync)."""
    num_rows, vocab = logits_TV.shape
    labels_T = labels_T.to(logits_TV.device)
    if out_TV is None:
        out_TV = torch.empty_like(logits_TV, memory_format=torch.contiguous_format)
    valid, in_range, index = _label_terms(labels_T, vocab, ignore_index)
    scale = grad_loss.reshape(()).float() / n_valid.reshape(()).float()
    for rows in _ref_rows(num_rows, vocab):
        p = torch.exp(logits_TV[rows].float() - lse_T[rows, None])
        p.scatter_add_(1, index[rows, None], -in_range[rows, None].float())
        out_TV[rows] = torch.where(valid[rows, None], p * scale, 0.0)
    return out_TV
