"""The route-weight gradient kernel against its pure-torch reference (interpreter, fp32 on the
CPU; bf16 out on CUDA): dp[t, j] = sum over columns of dp_part[token_slots[t, j]] in column order,
0 for a dropped route, rows no route names never read (NaN there must not leak), every output
element written, rounded once to out's dtype."""

import math

import pytest
import torch

from moegraph_kernels.route_grad import route_weight_grad, route_weight_grad_ref


def _case(T, k, C, drop, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    S = T * k + 7  # padding rows no route names
    dp = torch.randn(S, C, generator=g)
    dp[T * k:] = math.nan
    slots = torch.randperm(T * k, generator=g).view(T, k).to(torch.int32)
    slots[torch.rand(T, k, generator=g) < drop] = -1
    return dp.to(device), slots.to(device)


@pytest.mark.parametrize("T,k,C,drop", [(1, 1, 1, 0.0), (7, 3, 12, 0.3), (64, 8, 6, 0.0),
                                        (5, 4, 3, 1.0), (33, 2, 5, 0.5), (300, 1, 2, 0.1)])
def test_matches_reference_and_writes_every_element(T, k, C, drop, dtype=torch.float32):
    dp, slots = _case(T, k, C, drop, seed=T * 13 + C)
    out = torch.full((T, k), math.nan, dtype=dtype)
    route_weight_grad(dp, slots, out)
    assert torch.isfinite(out).all()
    ref = route_weight_grad_ref(dp, slots, dtype)
    assert torch.equal(out, ref)
    assert (out[slots < 0] == 0).all()
    # The column-order sum is torch's sum within fp32 rounding.
    live = slots >= 0
    loose = dp[slots.long().clamp(min=0)].sum(-1)[live]
    torch.testing.assert_close(out[live].float(), loose.to(dtype).float(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [16, 256])
def test_block_changes_no_value(block):
    """CUDA's default block (256) under the interpreter too: the same bits as the reference."""
    dp, slots = _case(300, 8, 12, 0.2, seed=5)
    out = route_weight_grad(dp, slots, torch.full((300, 8), math.nan), block=block)
    assert torch.equal(out, route_weight_grad_ref(dp, slots, torch.float32))


def test_rejects_a_wrong_layout():
    dp, slots = _case(4, 2, 3, 0.0, seed=1)
    with pytest.raises(ValueError, match="fp32"):
        route_weight_grad(dp.double(), slots, torch.empty(4, 2))
    with pytest.raises(ValueError, match="same contiguous shape"):
        route_weight_grad(dp, slots, torch.empty(2, 4))


@pytest.mark.cuda
@pytest.mark.parametrize("T,k,C", [(8192, 8, 12), (1, 1, 6), (1000, 4, 3)])
def test_cuda_matches_reference(T, k, C):
    dp, slots = _case(T, k, C, 0.1, seed=C, device="cuda")
    out = torch.full((T, k), math.nan, dtype=torch.bfloat16, device="cuda")
    route_weight_grad(dp, slots, out)
    assert torch.equal(out, route_weight_grad_ref(dp, slots, torch.bfloat16))
