"""The fused norm / rope kernels in a bf16 model on the GPU: the loss and the gradients agree
with the torch path (fused.ENABLED = False) to bf16 noise. (A whole captured step replaying
bitwise equal to eager with them is tests/gpu/test_step_cuda.py: the fused path is the default
on CUDA; the kernels' own graph-replay tests are in tests/kernels/.)"""

import copy

import pytest

from moegraph_cli.models import MoeCausalLM
from moegraph_cli.models.common import fused
from moegraph_cli.train.trainer import batches

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe",
                                     "tiny-deepseek-v3", "tiny-gpt-oss"])
def test_bf16_fused_matches_torch_path(profile, monkeypatch):
    """Both bf16 paths against the same weights in fp32 (torch path): the fused path's
    gradient error is at most twice the torch path's, over the whole model and per parameter
    (flash-attention's rule; a fixed relative bound between the two bf16 paths measured
    2.03% on the embedding's gradient, which says nothing about which is closer)."""
    model = MoeCausalLM.from_profile(profile, device="cuda")
    ref = copy.deepcopy(model)
    exact = copy.deepcopy(model).float()
    ids = next(batches(model.config.vocab_size, 2, 256, 0, "cuda"))
    losses, grads = [], []
    for m, enabled in ((model, True), (ref, False), (exact, False)):
        monkeypatch.setattr(fused, "ENABLED", enabled)
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    fused_g, torch_g, exact_g = grads
    assert abs(losses[0] - losses[2]) <= 2 * abs(losses[1] - losses[2]) + 1e-3 * losses[2], \
        losses
    floor = 1e-3  # relative: below it both paths are at bf16 resolution
    total_f = total_t = total = 0.0
    for n, want in exact_g.items():
        err_f = (fused_g[n] - want).norm().item()
        err_t = (torch_g[n] - want).norm().item()
        scale = want.norm().item()
        total_f, total_t, total = total_f + err_f ** 2, total_t + err_t ** 2, total + scale ** 2
        assert err_f <= 3 * max(err_t, floor * scale), (n, err_f, err_t, scale)
    assert total_f ** 0.5 <= 2 * max(total_t ** 0.5, floor * total ** 0.5), \
        (total_f ** 0.5, total_t ** 0.5)
