"""GPT-OSS experts (biases, clamped SwiGLU) on both expert paths, fp32 on the CPU.

permute_free_moe (Triton, interpreter) against reference_moe (torch) against loop_moe (fp64,
per route): forward output and every gradient (x, top-k weights, both weights, both biases).
Every buffer the kernels write is NaN-poisoned (`poisoned_scratch`) unless said otherwise.
The inputs put a good share of gate and up values past the clamp limit on every side, which
`_assert_clamps_exercised` checks, so both clamp branches are covered.
"""

import math

import pytest
import torch
from routing_cases import moe_inputs

from moegraph_cli import grads
from moegraph_cli.moe.activation import SWIGLU, ExpertAct, clamped_swiglu
from moegraph_cli.moe.experts import (permute_free_experts, permute_free_moe,
                                      permute_free_moe_with_drops, poisoned_scratch)
from moegraph_cli.moe.reference import loop_moe, reference_experts, reference_moe
from moegraph_cli.moe.routing import Dispatch

LIMIT = 1.0
ACT = clamped_swiglu(limit=LIMIT, alpha=1.702)
NAMES = ["y", "dx", "dtopk_weights", "dw_gate_up", "dw_down", "db_gate_up", "db_down"]


def _inputs(kind, T, k, E, H, F, seed=0):
    """(x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout), fp32; Y1 ~ N(0, ~1.4), so
    about a quarter of the gate and up values pass the limit of 1."""
    x, ids, w, w_gate_up, w_down, dout = moe_inputs(kind, T, k, E, H, F, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    b_gate_up = torch.randn(E, 2 * F, generator=gen)
    b_down = torch.randn(E, H, generator=gen) * 0.5
    return x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout


def _run(fn, x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout, act=ACT, **kw):
    """[y, *grads] with None for an absent bias (and its gradient)."""
    leaves = [None if t is None else t.clone().requires_grad_()
              for t in (x, w, w_gate_up, w_down, b_gate_up, b_down)]
    y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3], b_gate_up=leaves[4],
           b_down=leaves[5], act=act, **kw)
    live = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(y, live, dout.to(y.dtype)))
    return [y.detach(), *[None if t is None else next(got) for t in leaves]]


def _assert_close(got, want, rtol=1e-5, label=""):
    for name, g, r in zip(NAMES, got, want):
        if r is None:
            assert g is None, f"{label}{name}"
            continue
        assert torch.isfinite(g).all(), f"{label}{name} has non-finite values"
        scale = max(1.0, r.abs().max().item())
        torch.testing.assert_close(g.double(), r.double(), rtol=rtol, atol=rtol * scale,
                                   msg=lambda m: f"{label}{name}: {m}")


def _assert_clamps_exercised(x, ids, w_gate_up, b_gate_up, limit=LIMIT):
    """Every clamp branch is taken by some route: gate above the limit and below it, up above
    +limit, below -limit and in between."""
    ffn = w_gate_up.shape[1] // 2
    y1 = torch.einsum("th,tkfh->tkf", x, w_gate_up[ids]) + b_gate_up[ids]
    gate, up = y1[..., :ffn], y1[..., ffn:]
    assert (gate > limit).any() and (gate < limit).any()
    assert (up > limit).any() and (up < -limit).any() and (up.abs() < limit).any()


CASES = [  # (routing, T, k, E, H, F, capacity factor)
    ("uniform", 24, 2, 6, 33, 19, None),  # odd H, F: masked K and N tiles
    ("zipf", 32, 3, 7, 20, 45, 0.5),  # F spans two column tiles; capacity drops routes
    ("one_expert", 20, 1, 5, 24, 19, None),  # every token to one expert
    ("sparse_experts", 16, 2, 9, 17, 21, None),  # the even experts are empty
    ("uniform", 1, 2, 5, 33, 19, None),  # one token
    ("uniform", 8, 5, 5, 20, 17, None),  # k == E
    ("uniform", 16, 2, 4, 64, 32, None),  # even sizes: the unmasked-K / unmasked-N paths
]


@pytest.mark.parametrize("kind,T,k,E,H,F,cf", CASES)
def test_permute_free_matches_reference_and_loop(kind, T, k, E, H, F, cf):
    x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout = args = _inputs(kind, T, k, E, H, F,
                                                                          seed=T + E)
    _assert_clamps_exercised(x, ids, w_gate_up, b_gate_up)
    with poisoned_scratch():
        got = _run(permute_free_moe, *args, capacity_factor=cf)
    want = _run(reference_moe, *args, capacity_factor=cf)
    _assert_close(got, want, label="permute_free vs reference: ")

    keep = None
    if cf is not None:
        from moegraph_cli.moe.routing import local_dispatch
        keep = local_dispatch(ids, w, E, cf).keep_TK
        assert (~keep).any()
        assert (got[2][~keep] == 0).all(), "a dropped route's weight must get exact zero grad"
    loop = _run(lambda *a, **kw: loop_moe(*a, keep, **kw), *args)
    _assert_close(want, loop, rtol=1e-4, label="reference vs loop_moe: ")


@pytest.mark.parametrize("with_gu,with_down,act", [
    (True, True, SWIGLU),  # biases without the clamp
    (False, False, ACT),  # the clamp without biases
    (True, False, ACT), (False, True, ACT)])
def test_each_extra_alone(with_gu, with_down, act):
    x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout = _inputs("zipf", 24, 2, 5, 33, 19, 3)
    args = (x, ids, w, w_gate_up, w_down, b_gate_up if with_gu else None,
            b_down if with_down else None, dout)
    with poisoned_scratch():
        got = _run(permute_free_moe, *args, act=act)
    want = _run(reference_moe, *args, act=act)
    _assert_close(got, want)
    _assert_close(want, _run(loop_moe, *args, act=act), rtol=1e-4)


def test_values_exactly_at_the_clamp_limit_pass_the_gradient():
    """torch's clamp backward passes the gradient where min <= x <= max: expert 0 has zero
    weights, so its Y1 is exactly its bias, which sits on +limit, -limit and beyond."""
    T, k, E, H, F = 12, 2, 3, 16, 8
    x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout = _inputs("uniform", T, k, E, H, F, 7)
    ids[:, 0] = 0
    ids[:, 1] = torch.arange(T) % 2 + 1
    w_gate_up[0] = 0.0
    # A pair (g, u) with u <= -limit has uc + 1 = 0, which zeroes dg whatever the clamp.
    b_gate_up[0] = torch.tensor([1.0, -1.0, 2.0, 0.5, -3.0, 1.0, 0.1, 3.0,  # gate
                                 1.0, 0.5, -1.0, 2.0, -0.5, -2.0, 1.5, 0.75])  # up
    assert LIMIT == 1.0
    args = (x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout)
    with poisoned_scratch():
        got = _run(permute_free_moe, *args)
    want = _run(reference_moe, *args)
    _assert_close(got, want)
    db_gate, db_up = want[5][0, :F], want[5][0, F:]
    assert (db_gate[[0, 1, 3, 4, 6]] != 0).all() and (db_gate[[2, 5, 7]] == 0).all()
    assert (db_up[[0, 1, 2, 4, 7]] != 0).all() and (db_up[[3, 5, 6]] == 0).all()


def test_kept_route_mask_dispatch_matches_reference_experts():
    """The expert-parallel form: dropless over a kept-route mask (`permute_free_experts`)."""
    x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout = args = _inputs("uniform", 20, 3, 6,
                                                                          24, 19, seed=4)
    keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) < 0.6
    dispatch = Dispatch(keep, None, int(keep.sum()))
    with poisoned_scratch():
        got = _run(permute_free_experts, *args, dispatch=dispatch)
    want = _run(reference_experts, *args, dispatch=dispatch)
    _assert_close(got, want)
    assert (got[2][~keep] == 0).all()


def test_empty_experts_get_exact_zero_bias_grads():
    args = _inputs("sparse_experts", 16, 2, 6, 24, 19, seed=2)
    with poisoned_scratch():
        got = _run(permute_free_moe, *args)
    db_gate_up, db_down = got[5], got[6]
    assert (db_gate_up[0::2] == 0).all() and (db_down[0::2] == 0).all()
    assert (db_gate_up[1::2] != 0).any() and (db_down[1::2] != 0).any()


def test_two_runs_are_bitwise_identical():
    args = _inputs("zipf", 32, 3, 7, 33, 19, seed=11)
    with poisoned_scratch():
        first = _run(permute_free_moe, *args, capacity_factor=1.0)
    second = _run(permute_free_moe, *args, capacity_factor=1.0)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("fn", [permute_free_moe, reference_moe])
def test_zero_biases_and_default_act_leave_the_default_path_bitwise(fn):
    """Absent extras are today's path; zero biases add exact zeros to it (fp32 epilogues), so
    the bias machinery changes nothing else (dp's bias term adds dout . 0 = 0 too)."""
    x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout = _inputs("uniform", 16, 2, 5, 33, 19)
    leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up, w_down)]
    y = fn(leaves[0], ids, *leaves[1:])  # the pre-GPT-OSS call
    plain = [y.detach(), *torch.autograd.grad(y, leaves, dout)]
    zero = _run(fn, x, ids, w, w_gate_up, w_down, torch.zeros_like(b_gate_up),
                torch.zeros_like(b_down), dout, act=SWIGLU)
    explicit = _run(fn, x, ids, w, w_gate_up, w_down, None, None, dout, act=SWIGLU)
    for name, a, b, c in zip(NAMES, plain, zero, explicit):
        assert torch.equal(a, b), f"zero biases changed {name}"
        assert torch.equal(a, c), f"explicit defaults changed {name}"


def test_reference_default_path_is_the_original_formula():
    """reference_moe without extras computes exactly what it did before GPT-OSS."""
    x, ids, w, w_gate_up, w_down, _, _, _ = _inputs("zipf", 16, 2, 5, 24, 10, seed=6)
    ffn = 10
    want = torch.zeros(16, 24)
    for e in range(5):
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        y1 = torch.nn.functional.linear(x[tok], w_gate_up[e])
        a = torch.nn.functional.silu(y1[:, :ffn]) * y1[:, ffn:] * w[tok, j, None]
        want = want.index_put((tok,), torch.nn.functional.linear(a, w_down[e]), accumulate=True)
    got = reference_moe(x, ids, w, w_gate_up, w_down)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", [permute_free_moe, reference_moe])
def test_bias_grads_write_and_accumulate_into_sinks(fn):
    """Sinks get every gradient written into their NaN-poisoned `.grad` (exact zeros for the
    empty experts) and added to it in accumulate mode; nothing is returned to autograd."""
    x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout = _inputs("sparse_experts", 12, 2, 6,
                                                                    24, 19, seed=8)
    params = [torch.nn.Parameter(t.clone()) for t in (w_gate_up, w_down, b_gate_up, b_down)]

    def step():
        y = fn(x, ids, w, params[0], params[1], b_gate_up=params[2], b_down=params[3], act=ACT)
        y.backward(dout)

    step()
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad.fill_(math.nan)
        grads.sink(p)
    try:
        with poisoned_scratch(), grads.backward_pass(accumulate=False):
            step()
        for name, p, g in zip(NAMES[3:], params, want):
            assert torch.equal(p.grad, g), f"write mode: {name}"
        assert (params[2].grad[0::2] == 0).all() and (params[3].grad[0::2] == 0).all()
        with grads.backward_pass(accumulate=True):
            step()
        for name, p, g in zip(NAMES[3:], params, want):
            torch.testing.assert_close(p.grad, 2 * g, msg=lambda m: f"accumulate: {name}: {m}")
    finally:
        for p in params:
            grads.sink(p, False)


def test_capacity_drops_are_counted_with_biases():
    args = _inputs("tied_weights", 32, 3, 7, 33, 19, seed=5)
    x, ids, w, w_gate_up, w_down, b_gate_up, b_down, dout = args
    with poisoned_scratch():
        y, dropped = permute_free_moe_with_drops(x, ids, w, w_gate_up, w_down, 0.75,
                                                 b_gate_up=b_gate_up, b_down=b_down, act=ACT)
    want = reference_moe(x, ids, w, w_gate_up, w_down, 0.75, b_gate_up=b_gate_up,
                         b_down=b_down, act=ACT)
    assert int(dropped) > 0
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_expert_act_rejects_bad_values():
    assert SWIGLU == ExpertAct() and SWIGLU.clamp is None
    assert clamped_swiglu(7.0).clamp == (1.702, 7.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        ExpertAct("gelu")
    with pytest.raises(ValueError, match="needs both alpha and limit"):
        ExpertAct("clamped_swiglu", alpha=1.0)
    with pytest.raises(ValueError, match="takes no alpha or limit"):
        ExpertAct("swiglu", limit=7.0)
    with pytest.raises(ValueError, match="limit > 0"):
        clamped_swiglu(limit=-1.0)
    with pytest.raises(ValueError, match="limit > 0"):
        clamped_swiglu(limit=math.inf)


def test_bias_shapes_are_checked():
    x, ids, w, w_gate_up, w_down, b_gate_up, b_down, _ = _inputs("uniform", 4, 2, 5, 16, 8)
    with pytest.raises(ValueError, match=r"b_down has shape \[5, 15\], the expert weights "
                                         r"need \[5, 16\]"):
        permute_free_moe(x, ids, w, w_gate_up, w_down, b_down=b_down[:, 1:])
    with pytest.raises(ValueError, match="b_gate_up has shape"):
        permute_free_moe(x, ids, w, w_gate_up, w_down, b_gate_up=b_gate_up[:, :8])
    with pytest.raises(TypeError, match="act must be an ExpertAct"):
        permute_free_moe(x, ids, w, w_gate_up, w_down, act="clamped_swiglu")


def test_kept_activation_gives_the_bits_of_the_recomputed_one():
    """keep_act with biases and the clamped SwiGLU: FC1's kept activation (its bias inside Y1)
    is the one dA would recompute, so no output or gradient bit changes."""
    args = _inputs("zipf", 40, 3, 6, 24, 20, seed=21)
    outs = []
    for keep in (True, False):
        with poisoned_scratch():
            outs.append(_run(permute_free_moe, *args, keep_act=keep))
    for name, a, b in zip(NAMES, *outs):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name
