"""permute_free_moe on CUDA in bf16: accuracy against fp32, sync-freedom, CUDA-graph replay.

Accuracy follows flash-attention's rule: the kernels' error against an fp32 reference may be at
most twice the error of the reference itself run in bf16 (relative Frobenius norms, with a
small floor so a near-zero baseline cannot make the test flaky).
"""

import functools

import pytest
import torch
from routing_cases import moe_inputs

from moegraph_cli.moe.experts import permute_free_moe, poisoned_scratch
from moegraph_cli.moe.reference import reference_moe

pytestmark = pytest.mark.cuda
DEV = "cuda"
NAMES = ["y", "dx", "dtopk_weights", "dw_gate_up", "dw_down"]
ERROR_FLOOR = 2.0 ** -10


def _inputs(kind, T, k, E, H, F, seed=0):
    return [t.to(DEV) for t in moe_inputs(kind, T, k, E, H, F, seed)]


def _run(fn, x, ids, w, w_gate_up, w_down, dout, capacity_factor, dtype):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, w, w_gate_up, w_down)]
    y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3], capacity_factor)
    grads = torch.autograd.grad(y, leaves, dout.to(dtype))
    return [y.detach(), *grads]


def _rel_err(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


CASES = [  # (routing, T, k, E, H, F)
    ("uniform", 256, 4, 8, 256, 128),
    ("zipf", 384, 2, 16, 512, 192),
    ("one_expert", 200, 1, 5, 128, 96),  # every token to one expert
    ("sparse_experts", 160, 2, 9, 136, 72),  # empty experts, odd sizes
    ("uniform", 1, 2, 4, 128, 64),  # one token
    ("uniform", 64, 5, 5, 96, 80),  # k == E, prime E
    ("uniform", 97, 3, 7, 200, 100),  # sizes not multiples of 16
    ("uniform", 512, 8, 128, 2048, 768),  # Qwen3-30B-A3B experts
    # 128-row route blocks, where FC1 / FC2 split off the short last blocks (the split tail)
    ("zipf", 2048, 4, 8, 256, 128),
    ("uniform", 4096, 8, 128, 2048, 768),
]


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("kind,T,k,E,H,F", CASES)
def test_bf16_error_at_most_twice_reference_bf16(kind, T, k, E, H, F, capacity_factor):
    args = _inputs(kind, T, k, E, H, F, seed=T + E)
    with poisoned_scratch():
        got = _run(permute_free_moe, *args, capacity_factor, torch.bfloat16)
    ref_bf16 = _run(reference_moe, *args, capacity_factor, torch.bfloat16)
    ref_fp32 = _run(reference_moe, *args, capacity_factor, torch.float32)
    for name, g, b, r in zip(NAMES, got, ref_bf16, ref_fp32):
        assert torch.isfinite(g).all(), name
        if r.norm() == 0:  # e.g. every route dropped: both must be exactly zero
            assert (g == 0).all(), name
            continue
        err, base = _rel_err(g, r), _rel_err(b, r)
        assert err <= 2 * max(base, ERROR_FLOOR), f"{name}: error {err:.3g} vs bf16 ref {base:.3g}"


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_forward_backward_is_sync_free(capacity_factor):
    args = _inputs("zipf", 512, 8, 64, 512, 256)
    _run(permute_free_moe, *args, capacity_factor, torch.bfloat16)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(permute_free_moe, *args, capacity_factor, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("T,k,E,H,F", [(384, 4, 16, 256, 128),
                                       (2048, 4, 8, 256, 128)])  # 128-row blocks: split tail
def test_cuda_graph_replay_with_new_routing_matches_eager(capacity_factor, T, k, E, H, F):
    x, ids, w, w_gate_up, w_down, dout = _inputs("uniform", T, k, E, H, F)
    bf = torch.bfloat16
    static_x = x.to(bf).requires_grad_()
    static_w = w.to(bf).requires_grad_()
    static_ids = ids.clone()
    params = [w_gate_up.to(bf).requires_grad_(), w_down.to(bf).requires_grad_()]
    static_dout = dout.to(bf)

    def step():
        y = permute_free_moe(static_x, static_ids, static_w, *params, capacity_factor)
        return [y, *torch.autograd.grad(y, [static_x, static_w, *params], static_dout)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for i, kind in enumerate(["zipf", "one_expert", "sparse_experts", "uniform"]):
        nx, nids, nw, _, _, _ = _inputs(kind, T, k, E, H, F, seed=100 + i)
        with torch.no_grad():
            static_x.copy_(nx)
            static_ids.copy_(nids)
            static_w.copy_(nw)
        graph.replay()
        eager = _run(permute_free_moe, nx.to(bf), nids, nw.to(bf), *params, dout.to(bf),
                     capacity_factor, bf)
        for name, g, e in zip(NAMES, static_out, eager):
            assert torch.equal(g, e), f"replay {i} ({kind}): {name} differs from eager"


def test_two_runs_are_bitwise_identical():
    args = _inputs("zipf", 512, 8, 128, 2048, 768, seed=3)
    first = _run(permute_free_moe, *args, None, torch.bfloat16)
    second = _run(permute_free_moe, *args, None, torch.bfloat16)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind,T", [("zipf", 512), ("uniform", 4096)])
def test_kept_activation_gives_the_bits_of_the_recomputed_one(kind, T):
    """keep_act at the Qwen3 shape (64- and 128-row blocks, dA's paired tile at the latter):
    no bit of the output or a gradient changes, NaN-poisoned scratch."""
    args = _inputs(kind, T, 8, 128, 2048, 768, seed=5)
    outs = []
    for keep in (True, False):
        with poisoned_scratch():
            outs.append(_run(functools.partial(permute_free_moe, keep_act=keep), *args, None,
                             torch.bfloat16))
    for name, a, b in zip(NAMES, *outs):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


def test_slot_offsets_past_2_pow_31_elements():
    # S * 2F > 2^31: Y1 row offsets overflow int32 unless formed in int64. Per-token outputs
    # and dx depend only on that token's routes, so the last tokens are checked alone.
    T, k, E, H, F = 1 << 21, 1, 2, 64, 528
    x, ids, w, w_gate_up, w_down, dout = _inputs("uniform", T, k, E, H, F, seed=9)
    bf = torch.bfloat16
    xl = x.to(bf).requires_grad_()
    y = permute_free_moe(xl, ids, w.to(bf), w_gate_up.to(bf), w_down.to(bf))
    (dx,) = torch.autograd.grad(y, [xl], dout.to(bf))
    tail = slice(T - 512, T)
    sub = [x[tail], ids[tail], w[tail], w_gate_up, w_down, dout[tail]]
    ref_bf16 = _run(reference_moe, *sub, None, bf)
    ref_fp32 = _run(reference_moe, *sub, None, torch.float32)
    for name, g, b, r in [("y", y[tail], ref_bf16[0], ref_fp32[0]),
                          ("dx", dx[tail], ref_bf16[1], ref_fp32[1])]:
        err, base = _rel_err(g, r), _rel_err(b, r)
        assert err <= 2 * max(base, ERROR_FLOOR), f"{name}: error {err:.3g} vs {base:.3g}"
