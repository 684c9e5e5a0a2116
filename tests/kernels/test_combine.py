"""The gather-combine kernel against its pure-torch reference (interpreter, fp32 on the CPU;
bf16 on CUDA): out[t] = sum over j of src[token_slots[t, j]] in fp32 in j order, dropped
routes (-1) skipped, rows no token names never read (NaN there must not leak), every output
element written; and on CUDA the tile changes no value."""

import math

import pytest
import torch

from moegraph_kernels import combine


def combine_ref(src_SH, token_slots_TK):
    out = torch.zeros(token_slots_TK.shape[0], src_SH.shape[1], dtype=torch.float32,
                      device=src_SH.device)
    for j in range(token_slots_TK.shape[1]):
        slot = token_slots_TK[:, j].long()
        rows = src_SH[slot.clamp(min=0)].float()
        out = out + torch.where((slot >= 0)[:, None], rows, 0.0)
    return out.to(src_SH.dtype)


def _case(T, k, H, drop, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    S = T * k + 5  # padding rows no token names
    src = torch.randn(S, H, generator=g).to(device, dtype)
    slots = torch.randperm(T * k, generator=g)[: T * k].view(T, k).to(torch.int32)
    dropped = torch.rand(T, k, generator=g) < drop
    slots[dropped] = -1
    src[T * k:] = math.nan  # never read
    return src, slots.to(device)


@pytest.mark.parametrize("T,k,H,drop", [(1, 1, 1, 0.0), (7, 3, 33, 0.3), (64, 8, 100, 0.0),
                                        (5, 4, 64, 1.0), (33, 2, 130, 0.5)])
def test_matches_reference_and_writes_every_element(T, k, H, drop):
    src, slots = _case(T, k, H, drop, seed=T * 31 + H)
    out = torch.full((T, H), math.nan)
    combine.gather_combine(src, slots, out)
    assert torch.isfinite(out).all()
    assert torch.equal(out, combine_ref(src, slots))


@pytest.mark.cuda
@pytest.mark.parametrize("tile", ["4,1024,4", "1,2048,8", "16,256,4", "2,128,4"])
def test_tile_changes_no_value_on_cuda(tile, monkeypatch):
    src, slots = _case(1024, 8, 2048, 0.1, seed=0, device="cuda", dtype=torch.bfloat16)
    ref = combine_ref(src, slots)
    monkeypatch.setattr(combine, "TILE_OVERRIDE", tuple(int(v) for v in tile.split(",")))
    out = torch.full((1024, 2048), math.nan, device="cuda", dtype=torch.bfloat16)
    combine.gather_combine(src, slots, out)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("T,k,H,drop", [(1, 1, 1, 0.0), (7, 3, 33, 0.3), (33, 2, 130, 0.5)])
def test_base_is_added_as_torch_adds_it(T, k, H, drop):
    """With `base` (the residual stream) the output is base + the rounded sum, the bits of
    torch's add after the combine; base's row stride may exceed H."""
    src, slots = _case(T, k, H, drop, seed=T * 17 + H)
    g = torch.Generator().manual_seed(T + H)
    base = torch.randn(T, H + 3, generator=g)[:, :H]
    out = torch.full((T, H), math.nan)
    combine.gather_combine(src, slots, out, base)
    assert torch.equal(out, base + combine_ref(src, slots))


def test_base_of_another_shape_is_refused():
    src, slots = _case(4, 2, 8, 0.0, seed=1)
    with pytest.raises(ValueError, match="base must be"):
        combine.gather_combine(src, slots, torch.empty(4, 8), torch.zeros(4, 9))


@pytest.mark.cuda
def test_base_bf16_matches_torch_add_on_cuda():
    src, slots = _case(1024, 8, 2048, 0.1, seed=3, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 4
    out = torch.full((1024, 2048), math.nan, device="cuda", dtype=torch.bfloat16)
    combine.gather_combine(src, slots, out, base)
    assert torch.equal(out, base + combine_ref(src, slots))
