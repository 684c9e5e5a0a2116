"""Logits parity against transformers' own class of the model's family (Qwen3MoeForCausalLM,
MixtralForCausalLM, ...) on the same weights.

The comparison is made in float32, whatever dtype the run trains in: fp32 copies of both
models, moegraph's with the pure-torch expert path (the Triton kernels have their own tests
against it). In bfloat16 the two implementations round differently and a token whose top-k
experts are nearly tied can route differently, so a bf16 logit gap says little about the
model; the fp32 gap is the semantic check and must be within 1e-4. The weights go through
moegraph's own checkpoint writer and transformers' own loader, so the key map is covered too.
"""

from __future__ import annotations

import dataclasses
import tempfile

import torch

from .errors import UsageError

TOLERANCE = 1e-4


def hf_model_from(model, dtype: torch.dtype = torch.float32):
    try:
        import transformers
    except ImportError:
        raise UsageError("--reference transformers needs transformers installed "
                         "(pip install 'moegraph[test]')") from None
    from .checkpoint import save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        state = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
        save_checkpoint(state, model.config, tmp)
        hf_class = getattr(transformers, model.config.family.architecture)
        try:
            hf = hf_class.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # a class without SDPA support (GPT-OSS: its sinks)
            hf = hf_class.from_pretrained(tmp, dtype=dtype, attn_implementation="eager")
    return hf.to(next(model.parameters()).device).eval()


def fp32_reference_copy(model):
    """An fp32 copy of `model` on its device, experts on the pure-torch path."""
    from .models import MoeCausalLM

    moe = dataclasses.replace(model.moe_config, backend="reference")
    device = next(model.parameters()).device
    with torch.device("meta"):
        copy = MoeCausalLM(model.config, moe)
    state = {k: v.detach().to(device, torch.float32, copy=True)
             for k, v in model.state_dict().items()}
    copy.load_state_dict(state, assign=True, strict=True)
    return copy.eval()


def logits_parity(model, input_ids: torch.Tensor, impl: str = "transformers") -> dict:
    if impl != "transformers":
        raise UsageError(f"--reference {impl!r}: only 'transformers' is supported")
    ours = fp32_reference_copy(model)
    theirs = hf_model_from(model)
    with torch.no_grad():
        a = ours(input_ids).logits
        b = theirs(input_ids).logits.float()
    max_abs = (a - b).abs().max().item()
    del ours, theirs
    return {"impl": impl, "max_abs": max_abs, "tolerance": TOLERANCE,
            "passed": max_abs <= TOLERANCE, "compared_in": "float32",
            "model_dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
