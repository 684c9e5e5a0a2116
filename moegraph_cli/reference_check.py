"""Logits parity against transformers' Qwen3MoeForCausalLM on the same weights.

The weights go through moegraph's own checkpoint writer and transformers' own loader, so the
check also covers the key map. fp32 must agree to 1e-4; lower precisions report the figure
against a looser bound (different kernels round differently).
"""

from __future__ import annotations

import tempfile

import torch

from .errors import UsageError

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05}


def hf_model_from(model, device=None):
    try:
        from transformers import Qwen3MoeForCausalLM
    except ImportError:
        raise UsageError("--reference transformers needs transformers installed "
                         "(pip install 'moegraph[test]')") from None
    from .checkpoint import save_checkpoint

    dtype = next(model.parameters()).dtype
    with tempfile.TemporaryDirectory() as tmp:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        save_checkpoint(state, model.config, tmp)
        hf = Qwen3MoeForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa")
    return hf.to(device or next(model.parameters()).device).eval()


def logits_parity(model, input_ids: torch.Tensor, impl: str = "transformers") -> dict:
    if impl != "transformers":
        raise UsageError(f"--reference {impl!r}: only 'transformers' is supported")
    hf = hf_model_from(model)
    with torch.no_grad():
        ours = model(input_ids).logits.float()
        theirs = hf(input_ids).logits.float()
    dtype = next(model.parameters()).dtype
    max_abs = (ours - theirs).abs().max().item()
    tol = TOLERANCE[dtype]
    return {"impl": impl, "max_abs": max_abs, "tolerance": tol, "passed": max_abs <= tol,
            "dtype": str(dtype).replace("torch.", "")}
