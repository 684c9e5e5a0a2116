"""Cross-entropy forward and its dlogits in one kernel, in place over the logits.

`cross_entropy_fused_(logits, labels, n_valid)` gives what cross_entropy.py's forward gives
(lse [T], loss [T], fp32) and overwrites each logits row with the row's dlogits for an
incoming gradient of 1:

    dlogits[t, v] = (exp(logits[t, v] - lse[t]) - [v == labels[t]]) * (1 / max(n_valid, 1))

the backward kernel's formula, op for op, so given the same lse its bits are
`cross_entropy_backward`'s with grad_loss = 1. `scale_by_grad_(dlogits, grad_loss)` then
multiplies by the gradient that really came, and does nothing at all when it is 1 (what
`loss.backward()` gives): the kernel reads it on the device and skips the pass, no host sync.
For another gradient dlogits is rounded twice (once here, once by the scale), as
loss_chunked.py's backward does.

Why: the two-kernel path reads the logits twice from device memory (the forward's lse pass,
then the backward's) and writes them once. Here one persistent program an SM takes a row at
a time: it streams the row for its lse, then reads it again, from L2 where the row still is
(`REVERSE` walks it back from the end, the lines read last first), and writes dlogits over
it. The row's lse, and so every dlogits bit, depends only on the row, the block and the
warps: deterministic, and the same in eager and in a graph.

Layout contract: cross_entropy.py's (logits [T, V] with a contiguous last dimension, any row
stride; labels [T] int32 / int64, ignore_index rows: lse = loss = 0 and a zero dlogits row,
their logits never read; a label outside [0, V) gives a NaN loss). n_valid: a 0-d or [1]
device tensor, the number of kept rows. The label's logit is read before the row is
overwritten (a barrier orders every warp's read before any warp's store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cross_entropy import _check_rows, _online_max_sum
from .env import flag_from_env, ints_from_env
from .fp_fusion import FUSED

# Tile of the GPU launch: columns a step, warps, programs an SM, the re-read walked backward,
# loads pipelined that deep. H100, [16384, 151936] bf16 (results/ce_fused_ab_big_h100.json):
# 4.625 ms against 4.862 for the two kernels; 3 stages 0.956x, 2 stages 1.163x, not
# pipelined 1.273x, two programs an SM 0.953x, walked forward 1.004x.
# Elsewhere (the interpreter) the forward kernel's block: the same lse bits as
# cross_entropy_forward there. MOEGRAPH_CE_FUSED_TILE="block,warps,per_sm,stages" (stages 1:
# not pipelined) overrides the GPU's, read once here.
BLOCK_GPU, WARPS_GPU, PER_SM_GPU, REVERSE_GPU, STAGES_GPU = 16384, 16, 1, True, 4
TILE_OVERRIDE = ints_from_env("MOEGRAPH_CE_FUSED_TILE", "block,warps,per_sm,stages")
if TILE_OVERRIDE is not None:
    BLOCK_GPU, WARPS_GPU, PER_SM_GPU, STAGES_GPU = TILE_OVERRIDE


def enabled() -> bool:
    """Whether the trainers' loss heads (models/common/loss.py, loss_chunked.py) take this
    kernel: MOEGRAPH_CE_FUSED, on unless 0; read at each call."""
    return flag_from_env("MOEGRAPH_CE_FUSED", True)


@triton.jit
def _ce_fused_kernel(
    logits_ptr, labels_ptr, lse_ptr, loss_ptr, one_ptr, n_valid_ptr,
    n_rows, V, stride_row, ignore_index,
    BLOCK_V: tl.constexpr, REVERSE: tl.constexpr, EVICT_LAST: tl.constexpr,
    STAGES: tl.constexpr,
):
    # The backward kernel's scale with grad_loss = 1 loaded the same way: the same division.
    scale = tl.load(one_ptr).to(tl.float32) / tl.maximum(
        tl.load(n_valid_ptr).to(tl.float32), 1.0)
    cols = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(V, BLOCK_V)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        label = tl.load(labels_ptr + row)
        valid = label != ignore_index
        row_ptr = logits_ptr + tl.cast(row, tl.int64) * stride_row
        in_range = (label >= 0) & (label < V)
        x_label = tl.load(row_ptr + label, mask=valid & in_range,
                          other=float("nan")).to(tl.float32)
        n_cols = tl.where(valid, V, 0)  # an ignored row reads nothing
        m, d = _online_max_sum(row_ptr, 0, n_cols, BLOCK_V, EVICT_LAST, STAGES)
        lse = m + tl.log(tl.where(valid, d, 1.0))  # the sum is >= 1 if valid
        tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
        tl.store(loss_ptr + row, tl.where(valid, lse - x_label, 0.0))
        tl.debug_barrier()  # every warp has its x_label before any warp overwrites the row
        for i in tl.range(0, n_blocks, num_stages=STAGES):
            if REVERSE:
                start = (n_blocks - 1 - i) * BLOCK_V
            else:
                start = i * BLOCK_V
            c = start + cols
            x = tl.load(row_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(c == label, 1.0, 0.0)) * scale
            g = tl.where(valid, g, 0.0)
            tl.store(row_ptr + c, g.to(logits_ptr.dtype.element_ty), mask=c < V)
        tl.debug_barrier()  # the next row's reads start after this row's stores


@triton.jit
def _scale_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """x *= g over x's n elements, skipped whole when g == 1 (x * 1 == x)."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        offs0 = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n,
                           tl.num_programs(0).to(tl.int64) * BLOCK):
            offs = start + offs0
            x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
            tl.store(x_ptr + offs, (x * g).to(x_ptr.dtype.element_ty), mask=offs < n)


def _stages(stages: int) -> int | None:
    return stages if stages > 1 else None


def _programs(device: torch.device, per_sm: int, n_rows: int) -> int:
    if device.type != "cuda":
        return max(1, min(n_rows, 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_rows, sms * per_sm))


def cross_entropy_fused_(logits_TV: torch.Tensor, labels_T: torch.Tensor, n_valid: torch.Tensor,
                         ignore_index: int = -100, *, block_v: int | None = None,
                         num_warps: int | None = None, per_sm: int | None = None,
                         reverse: bool | None = None, evict_last: bool = False,
                         stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [T], loss [T]) of logits_TV's rows, the rows overwritten with dlogits for an
    incoming gradient of 1 (module docstring). block_v, num_warps, per_sm, reverse,
    evict_last, stages (loads pipelined that deep; 1 or less: not): for tuning."""
    _check_rows("logits", logits_TV, labels_T)
    num_rows, vocab = logits_TV.shape
    dev = logits_TV.device
    lse_T = torch.empty(num_rows, dtype=torch.float32, device=dev)
    loss_T = torch.empty(num_rows, dtype=torch.float32, device=dev)
    if num_rows == 0:
        return lse_T, loss_T
    gpu = dev.type == "cuda"
    block = min(block_v or (BLOCK_GPU if gpu else 4096), triton.next_power_of_2(vocab))
    one = torch.ones(1, dtype=torch.float32, device=dev)
    grid = (_programs(dev, per_sm or PER_SM_GPU, num_rows),)
    _ce_fused_kernel[grid](
        logits_TV, labels_T.contiguous(), lse_T, loss_T, one, n_valid,
        num_rows, vocab, logits_TV.stride(0), ignore_index,
        BLOCK_V=block, REVERSE=REVERSE_GPU if reverse is None else reverse,
        EVICT_LAST=evict_last and gpu,
        STAGES=_stages(stages if stages is not None else STAGES_GPU if gpu else 1),
        num_warps=num_warps or (WARPS_GPU if gpu else 4), enable_fp_fusion=FUSED)
    return lse_T, loss_T


def scale_by_grad_(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """x *= grad (a 0-d or [1] device tensor) in place, in x's dtype; no work, and no host
    sync, when grad == 1. x must be contiguous."""
    if not x.is_contiguous():
        raise ValueError("scale_by_grad_: x must be contiguous")
    n = x.numel()
    if n == 0:
        return x
    gpu = x.device.type == "cuda"
    block = 4096 if gpu else 64
    grid = (_programs(x.device, 4, triton.cdiv(n, block)),)
    _scale_kernel[grid](x, grad.reshape(1).float(), n, BLOCK=block,
                        num_warps=8 if gpu else 4, enable_fp_fusion=FUSED)
    return x


# -- pure-torch reference -------------------------------------------------------------------
def cross_entropy_fused_ref_(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                             n_valid: torch.Tensor, ignore_index: int = -100
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_fused_ in torch: the reference forward, then the reference backward
    with grad_loss = 1 over the logits in place."""
    from .cross_entropy import cross_entropy_backward_ref, cross_entropy_forward_ref
    lse_T, loss_T = cross_entropy_forward_ref(logits_TV, labels_T, ignore_index)
    one = torch.ones((), dtype=torch.float32, device=logits_TV.device)
    cross_entropy_backward_ref(logits_TV, labels_T, lse_T, one, n_valid, ignore_index,
                               logits_TV)
    return lse_T, loss_T


def scale_by_grad_ref_(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """scale_by_grad_ in torch (x * g in fp32, rounded to x's dtype; x unchanged if g == 1)."""
    g = grad.reshape(()).float()
    return x.copy_(torch.where(g == 1, x.float(), x.float() * g))
