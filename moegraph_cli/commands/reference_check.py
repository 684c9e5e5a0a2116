"""Logits parity against transformers' own class of the model's family (Qwen3MoeForCausalLM,
MixtralForCausalLM, ...) on the same weights.

The comparison is made in float32, whatever dtype the run trains in: fp32 copies of both
models, moegraph's with the pure-torch expert path (the Triton kernels have their own tests
against it). In bfloat16 the two implementations round differently and a token whose top-k
experts are nearly tied can route differently, so a bf16 logit gap says little about the
model; the fp32 gap is the semantic check and must be within 1e-4. The weights go through
moegraph's own checkpoint writer and transformers' own loader, so the key map is covered too.

Even in fp32 the two can pick different experts for a token whose k-th and (k+1)-th router
scores are closer than the two implementations' rounding (about 1e-6 of the score). The result
therefore also carries, per token, the smallest such router margin over the layers, the first
position whose margin is under NEAR_TIE, and the largest gap over the positions before it in
each row: with causal attention those positions cannot see the tie, so they are compared on
the same routing. `passed` stays the plain whole-batch bound; the rest explains a failure.
"""

from __future__ import annotations

import dataclasses
import tempfile

import torch

from ..errors import UsageError

TOLERANCE = 1e-4
NEAR_TIE = 1e-4  # router-score gap under which fp32 rounding may swap the k-th expert


def honour_config(hf) -> list[str]:
    """The config fields `hf` (a transformers model) ignores, now set on it from its config;
    [] where it reads them all. GPT-OSS's gated activation takes `swiglu_alpha` and
    `swiglu_limit` from the config, as moegraph's does; some transformers releases (5.17)
    hard-code 1.702 and 7.0 in GptOssExperts instead (5.25 reads the config), so a config
    with other values would be compared against another model. Such a reference is given the
    config's values, and the parity result names them."""
    cfg, fields = hf.config, set()
    for m in hf.modules():
        if type(m).__name__ != "GptOssExperts":
            continue
        for attr, field in (("alpha", "swiglu_alpha"), ("limit", "swiglu_limit")):
            want = getattr(cfg, field, None)
            if want is not None and getattr(m, attr, want) != want:
                setattr(m, attr, want)
                fields.add(field)
    return sorted(fields)


def hf_model_from(model, dtype: torch.dtype = torch.float32):
    try:
        import transformers
    except ImportError:
        raise UsageError("--reference transformers needs transformers installed "
                         "(pip install 'moegraph[test]')") from None
    from ..io.checkpoint_save import save_checkpoint

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
    from ..models import MoeCausalLM

    moe = dataclasses.replace(model.moe_config, backend="reference")
    device = next(model.parameters()).device
    with torch.device("meta"):
        copy = MoeCausalLM(model.config, moe)
    state = {k: v.detach().to(device, torch.float32, copy=True)
             for k, v in model.state_dict().items()}
    copy.load_state_dict(state, assign=True, strict=True)
    return copy.eval()


def _selection_scores(scope, x: torch.Tensor) -> torch.Tensor:
    """The scores a MoE scope's router ranks experts by (fp32). Softmax is monotone, so the
    logits rank as the probabilities do; DeepSeek-V3's sigmoid plus correction bias is ranked
    before its group limit, so its margin is that of the plain top-k (a diagnostic, not the
    exact group-limited choice)."""
    logits = torch.nn.functional.linear(x.float(), scope.router.weight.float(),
                                        None if scope.router.bias is None
                                        else scope.router.bias.float())
    if getattr(scope, "grouped", False):
        return torch.sigmoid(logits) + scope.e_score_correction_bias.float()
    return logits


def logits_and_margins(model, input_ids: torch.Tensor):
    """The model's logits, and per token [B, S] the smallest gap over the MoE layers between
    the k-th and (k+1)-th router score (inf where no layer routes or k == E)."""
    from ..models.common.ffn import MoeScope

    batch, seq = input_ids.shape
    margin = torch.full((batch, seq), float("inf"), device=input_ids.device)
    handles = []

    def hook(scope):
        def on_norm(_module, _args, x):
            if isinstance(x, tuple):  # the norm called with skip=True: (y, its input)
                x = x[0]
            scores = _selection_scores(scope, x)
            if scope.top_k < scores.shape[-1]:
                top = scores.topk(scope.top_k + 1, dim=-1).values
                gap = (top[..., -2] - top[..., -1]).view(batch, seq)
                torch.minimum(margin, gap.to(margin.device), out=margin)
        return on_norm

    for module in model.modules():
        if isinstance(module, MoeScope):
            handles.append(module.post_norm.register_forward_hook(hook(module)))
    try:
        with torch.no_grad():
            logits = model(input_ids).logits
    finally:
        for h in handles:
            h.remove()
    return logits, margin


def logits_parity(model, input_ids: torch.Tensor, impl: str = "transformers") -> dict:
    if impl != "transformers":
        raise UsageError(f"--reference {impl!r}: only 'transformers' is supported")
    ours = fp32_reference_copy(model)
    theirs = hf_model_from(model)
    set_from_config = honour_config(theirs)
    a, margin_BS = logits_and_margins(ours, input_ids)
    with torch.no_grad():
        b = theirs(input_ids).logits.float()
    gap_BS = (a - b).abs().amax(dim=-1)
    del ours, theirs, a, b
    max_abs = gap_BS.max().item()
    ties = explain_gap(gap_BS, margin_BS)
    return {"impl": impl, "max_abs": max_abs, "tolerance": TOLERANCE,
            "passed": max_abs <= TOLERANCE, "compared_in": "float32",
            "reference_set_from_config": set_from_config,
            "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""), **ties}


def explain_gap(gap_BS: torch.Tensor, margin_BS: torch.Tensor) -> dict:
    """The router-tie figures of the docstring from per-token logit gaps and margins."""
    seq = gap_BS.shape[1]
    pos = torch.arange(seq, device=gap_BS.device)
    tie_BS = margin_BS < NEAR_TIE
    first_tie_B = torch.where(tie_BS, pos, seq).amin(dim=1)
    over_BS = gap_BS > TOLERANCE
    first_over_B = torch.where(over_BS, pos, seq).amin(dim=1)
    before = pos[None, :] < first_tie_B[:, None]
    finite = margin_BS[torch.isfinite(margin_BS)]
    return {
        "min_router_margin": finite.min().item() if finite.numel() else None,
        "near_ties": int(tie_BS.sum().item()),
        "first_near_tie": None if bool((first_tie_B == seq).all())
        else int(first_tie_B.min().item()),
        "first_over_tolerance": None if bool((first_over_B == seq).all())
        else int(first_over_B.min().item()),
        "max_abs_before_near_tie": gap_BS[before].max().item() if bool(before.any()) else None,
    }
