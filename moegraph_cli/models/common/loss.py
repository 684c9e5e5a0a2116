"""LM head + next-token cross-entropy with no fp32 [tokens, vocab] tensor.

`linear_cross_entropy(x, w, labels)` is `F.cross_entropy(F.linear(x, w).float(), labels,
ignore_index)` (mean over kept tokens) with the same values in fp32 and the same logits GEMM,
but the softmax statistics are computed by kernels/cross_entropy.py straight from the
x-dtype logits: fp32 exists only per row (lse [T]) or per register tile.

Memory, with T tokens, V vocab, logits in bf16 (2 bytes):
- forward: the logits [T, V] (returned to the caller and saved for backward) -- 2 B/element.
  `causal_lm_loss` holds those plus an fp32 copy and fp32 log-softmax: 10 B/element at peak.
- backward: the logits plus dlogits [T, V] in the logits' dtype -- 4 B/element; 2 with
  `inplace_backward=True`, where dlogits overwrites the logits buffer (the returned logits
  then hold dlogits once backward has run: only for callers done with them by then).
  The fp32 path peaks at about 16 B/element (fp32 grad, softmax, the bf16 cast).
The logits GEMM is not chunked over rows here: the logits are returned, so the full [T, V]
buffer exists anyway. The loss-only head of loss_chunked.py (`head_loss(..., chunk_rows=N)`,
`run.loss_chunk`) runs it in row chunks with dlogits and both gradient GEMMs in the forward,
holding one chunk's logits instead of all of them.

Gradients: dx = dlogits @ w; dW = dlogits^T @ x through `grads.mm_grad`, so a sink parameter
gets it written (or accumulated) into `w.grad` and autograd gets None (see grads.py). A tied
embedding in non-sink mode gets dW returned and summed by autograd as usual.

The path: Triton on CUDA; on CPU the chunked pure-torch reference with the same contract
(`impl="reference"` forces it anywhere; `impl="triton"` forces the kernels, which on CPU run
only under TRITON_INTERPRET=1 and only in fp32). Neither path syncs with the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ... import grads
from ...matmul import linear, matmul
from .linear import linear as module_linear

IMPLS = ("auto", "triton", "reference")


def causal_shift(labels_BS: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF's shifted labels: position s predicts token s + 1, the last one predicts nothing."""
    return F.pad(labels_BS, (0, 1), value=ignore_index)[..., 1:]


def _use_triton(impl: str, device: torch.device) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"linear_cross_entropy: impl must be one of {', '.join(IMPLS)}, "
                         f"got {impl!r}")
    return impl == "triton" or (impl == "auto" and device.type == "cuda")


class LinearCrossEntropy(torch.autograd.Function):
    """Outputs (loss 0-d fp32, logits [T, V] non-differentiable); differentiable in x and w."""

    @staticmethod
    def forward(ctx, x_TH, w_VH, labels_T, ignore_index, use_triton, inplace_backward):
        ctx.set_materialize_grads(False)  # else backward gets a zero [T, V] for the logits
        logits_TV = linear(x_TH, w_VH)
        # Imported here: the kernels module imports Triton, which commands that never train
        # (init, inspect, plan) must not need.
        from moegraph_kernels import cross_entropy as ce
        fwd = ce.cross_entropy_forward if use_triton else ce.cross_entropy_forward_ref
        lse_T, loss_T = fwd(logits_TV, labels_T, ignore_index)
        n_valid = (labels_T != ignore_index).sum()
        loss = loss_T.sum() / n_valid  # 0 / 0 = nan when every label is ignored, as torch
        ctx.mark_non_differentiable(logits_TV)
        ctx.save_for_backward(x_TH, w_VH, logits_TV, labels_T, lse_T, n_valid)
        ctx.ignore_index = ignore_index
        ctx.use_triton = use_triton
        ctx.inplace_backward = inplace_backward
        ctx.logits_consumed = False
        return loss, logits_TV

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_logits):
        if grad_loss is None:
            return None, None, None, None, None, None
        if ctx.logits_consumed:
            raise RuntimeError("linear_cross_entropy: backward ran twice with "
                               "inplace_backward=True, whose first backward overwrote the "
                               "saved logits")
        x_TH, w_VH, logits_TV, labels_T, lse_T, n_valid = ctx.saved_tensors
        out_TV = logits_TV if ctx.inplace_backward else None
        from moegraph_kernels import cross_entropy as ce
        bwd = ce.cross_entropy_backward if ctx.use_triton else ce.cross_entropy_backward_ref
        with torch.no_grad():
            dlogits_TV = bwd(logits_TV, labels_T, lse_T, grad_loss.float(), n_valid,
                             ctx.ignore_index, out_TV)
        ctx.logits_consumed = ctx.inplace_backward
        dx = matmul(dlogits_TV, w_VH) if ctx.needs_input_grad[0] else None
        dw = grads.mm_grad(w_VH, dlogits_TV.t(), x_TH) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


def linear_cross_entropy(x_TH: torch.Tensor, w_VH: torch.Tensor, labels_T: torch.Tensor,
                         ignore_index: int = -100, *, impl: str = "auto",
                         inplace_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits): loss = mean over tokens whose label != ignore_index of the fp32
    cross-entropy of logits = F.linear(x, w) (in x's dtype), a differentiable 0-d fp32 tensor
    (nan when every label is ignored, as F.cross_entropy); logits, not differentiable, shaped
    [..., V]. x is [T, H] or [..., H] with labels of its leading shape (already shifted: see
    `causal_shift`); w is [V, H]. `impl`: auto | triton | reference (module docstring);
    `inplace_backward`: dlogits overwrite the returned logits' storage in backward."""
    hidden = x_TH.shape[-1]
    vocab = w_VH.shape[0]
    if w_VH.dim() != 2 or w_VH.shape[1] != hidden:
        raise ValueError(f"linear_cross_entropy: weight has shape {list(w_VH.shape)}, "
                         f"expected [vocab, {hidden}]")
    if labels_T.shape != x_TH.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: labels has shape {list(labels_T.shape)}, "
                         f"expected {list(x_TH.shape[:-1])} (the hidden states' leading shape)")
    use_triton = _use_triton(impl, x_TH.device)
    loss, logits_TV = LinearCrossEntropy.apply(
        x_TH.reshape(-1, hidden), w_VH, labels_T.reshape(-1).to(x_TH.device).contiguous(),
        ignore_index, use_triton, inplace_backward)
    return loss, logits_TV.view(*x_TH.shape[:-1], vocab)


class LmHead(torch.nn.Linear):
    """The untied lm head, an nn.Linear [V, H] without bias (same parameter, same state-dict
    key) whose forward is the head with the loss: `(loss, logits)` of
    `linear_cross_entropy`, or `(None, logits)` without labels. Called as a module, so
    FSDP2 can shard it with the final norm as a unit of its own (distributed/model.py)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__(hidden, vocab, bias=False)

    def forward(self, x_TH: torch.Tensor, labels_T: torch.Tensor | None = None, *,
                inplace_backward: bool = False, chunk_rows: int = 0
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return head_loss(x_TH, self.weight, labels_T, inplace_backward, chunk_rows)


def head_loss(x_TH: torch.Tensor, w_VH: torch.Tensor, labels_T: torch.Tensor | None,
              inplace_backward: bool = False, chunk_rows: int = 0
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits) through the head w: `linear_cross_entropy` with labels, else
    (None, linear.linear(x, w): the logits, a sink weight's gradient written by the GEMM).
    `chunk_rows` > 0 with labels: (loss, None) of loss_chunked.py's head, `chunk_rows` rows at
    a time, no logits kept (for callers that want none: the trainers)."""
    if labels_T is None:
        return None, module_linear(x_TH, w_VH)
    if chunk_rows > 0:
        from .loss_chunked import chunked_linear_cross_entropy
        return chunked_linear_cross_entropy(
            x_TH, w_VH, labels_T, chunk_rows,
            use_triton=_use_triton("auto", x_TH.device)), None
    return linear_cross_entropy(x_TH, w_VH, labels_T, inplace_backward=inplace_backward)
