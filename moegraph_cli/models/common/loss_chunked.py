"""The lm head and loss in row chunks, for training: no [T, V] tensor at all.

`chunked_linear_cross_entropy(x, w, labels, rows)` is loss.linear_cross_entropy's loss (the
mean fp32 cross-entropy over kept tokens of logits = x @ w.T in x's dtype, the same kernels)
without its logits: for each chunk of `rows` rows it forms the chunk's logits, their lse and
per-token loss, and, where a gradient is wanted, overwrites the chunk's logits with dlogits
and runs both gradient GEMMs at once (dx of the chunk's rows; dW += dlogits^T x, rounded into
W's dtype after each chunk), all in the forward. The backward only scales both by the
incoming gradient (exact when it is 1, as `loss.backward()` gives).

Memory, T tokens, V vocab, H hidden, b bytes of the model dtype: one chunk's logits
(b * rows * V) while the forward runs, then dx (b * T * H) and dW (b * V * H) from the forward
to the backward, in place of loss.py's logits (b * T * V) from the forward to the backward.
For Qwen3's 151,936-token vocabulary at 16,384 tokens: 4.64 GiB of logits against a 1.16 GiB
chunk of 4,096 rows and 0.64 GiB of dx and dW.

What it costs: the same GEMM and kernel FLOPs in `T / rows` pieces, dW summed over the
chunks in W's dtype (one rounding a chunk, where loss.py's one GEMM rounds once), and one pass
over dW and dx in the backward for the scale. Eager and graph replay run the same chunks in the
same order, so they agree bitwise; against loss.py's unchunked head the loss and gradients
agree to rounding. A forward without a gradient wanted (no_grad, or neither x nor w requiring
one) computes only the loss.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ... import grads
from ...matmul import addmm_, linear, mm_out


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Output: the loss (0-d fp32); differentiable in x and w."""

    @staticmethod
    def forward(ctx, x_TH, w_VH, labels_T, ignore_index, use_triton, rows):
        from moegraph_kernels import cross_entropy as ce
        fwd = ce.cross_entropy_forward if use_triton else ce.cross_entropy_forward_ref
        bwd = ce.cross_entropy_backward if use_triton else ce.cross_entropy_backward_ref
        need_x, need_w = ctx.needs_input_grad[:2]
        num_tokens = x_TH.shape[0]
        n_valid = (labels_T != ignore_index).sum()
        one = torch.ones((), dtype=torch.float32, device=x_TH.device)
        loss_T = torch.empty(num_tokens, dtype=torch.float32, device=x_TH.device)
        dx_TH = torch.empty_like(x_TH) if need_x else None
        dw_VH = torch.empty_like(w_VH) if need_w else None
        for lo in range(0, num_tokens, rows):
            hi = min(lo + rows, num_tokens)
            x_c, labels_c = x_TH[lo:hi], labels_T[lo:hi]
            logits_c = linear(x_c, w_VH)
            lse_c, loss_c = fwd(logits_c, labels_c, ignore_index)
            loss_T[lo:hi] = loss_c
            if not (need_x or need_w):
                continue
            # dlogits of the mean loss (incoming gradient 1), over the chunk's own logits
            dl_c = bwd(logits_c, labels_c, lse_c, one, n_valid, ignore_index, logits_c)
            if need_x:
                mm_out(dl_c, w_VH, dx_TH[lo:hi])
            if need_w:
                if lo == 0:
                    mm_out(dl_c.t(), x_c, dw_VH)
                else:
                    addmm_(dw_VH, dl_c.t(), x_c)
            del logits_c, dl_c
        loss = loss_T.sum() / n_valid  # 0 / 0 = nan when every label is ignored, as torch
        ctx.save_for_backward(dx_TH, dw_VH)
        ctx.w = w_VH
        ctx.done = False
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if grad_loss is None:
            return None, None, None, None, None, None
        if ctx.done:
            raise RuntimeError("chunked_linear_cross_entropy: backward ran twice; its "
                               "first backward scaled the gradients the forward computed")
        ctx.done = True
        dx_TH, dw_VH = ctx.saved_tensors
        g = grad_loss.reshape(()).float()
        dx = None if dx_TH is None else dx_TH.mul_(g)
        dw = None if dw_VH is None else _deposit_scaled(ctx.w, dw_VH, g)
        return dx, dw, None, None, None, None


def _deposit_scaled(w: torch.Tensor, dw: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """g * dw as w's gradient: written into (or added to) `.grad` in one pass for a sink
    (returns None), else scaled in place and returned (grads.deposit's contract)."""
    where = grads.target(w)
    if where is None:
        return dw.mul_(g)
    grad, acc = where
    with torch.no_grad():
        if acc:
            grad.addcmul_(dw, g)
        else:
            torch.mul(dw, g, out=grad)
    return None


def chunked_linear_cross_entropy(x_TH: torch.Tensor, w_VH: torch.Tensor, labels_T: torch.Tensor,
                                 rows: int, ignore_index: int = -100, *,
                                 use_triton: bool) -> torch.Tensor:
    """The loss of loss.linear_cross_entropy over chunks of `rows` rows (module docstring);
    x [T, H] or [..., H] with labels of its leading shape (already shifted), w [V, H]."""
    if rows <= 0:
        raise ValueError(f"chunked_linear_cross_entropy: rows must be positive, got {rows}")
    hidden = x_TH.shape[-1]
    return ChunkedLinearCrossEntropy.apply(
        x_TH.reshape(-1, hidden), w_VH, labels_T.reshape(-1).to(x_TH.device).contiguous(),
        ignore_index, use_triton, rows)
