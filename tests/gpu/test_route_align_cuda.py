"""The counting-sort RouteList on CUDA equals the torch reference (stable sort) bit for bit, at
the Qwen3 shapes (N = 8192 and N = 262144 routes over 128 experts, and 256 experts), with no
host sync, regardless of what its buffers held, and replayed from a CUDA graph."""

import pytest
import torch
from routing_cases import make_routing

from moegraph_cli.moe.routing import capacity_keep_TK, expert_capacity
from moegraph_kernels.route_align import build_route_list, build_route_list_ref

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _dispatch(kind, T, k, E, mode, seed=0):
    ids, w = make_routing(kind, T, k, E, seed=seed)
    if mode == "dropless":
        return ids.to(DEV), None, None, None
    if mode == "capacity":
        cap = expert_capacity(T, k, E, 1.0)
        return ids.to(DEV), capacity_keep_TK(ids, w, E, cap).to(DEV), cap, None
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(T, k, generator=gen) < 0.5
    return ids.to(DEV), keep.to(DEV), None, int(keep.sum())


def _assert_same(got, want):
    for name in want._fields[:-1]:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


CASES = [  # (routing, T, k, E, BM)
    ("uniform", 1024, 8, 128, 64),  # Qwen3-30B-A3B, T = 1024: N = 8192
    ("zipf", 1024, 8, 128, 128),
    ("uniform", 32768, 8, 128, 128),  # N = 262144
    ("zipf", 4096, 8, 256, 64),  # E = 256
    ("one_expert", 2000, 1, 5, 64),  # every token to one expert
    ("sparse_experts", 300, 2, 9, 16),  # empty experts
    ("uniform", 1, 2, 4, 16),  # one token
    ("uniform", 64, 5, 5, 16),  # k == E, prime E
    ("tied_weights", 777, 3, 11, 32),
]


@pytest.mark.parametrize("mode", ["dropless", "capacity", "masked"])
@pytest.mark.parametrize("kind,T,k,E,BM", CASES)
def test_counting_sort_equals_stable_sort(kind, T, k, E, BM, mode):
    ids, keep, cap, max_kept = _dispatch(kind, T, k, E, mode, seed=T + E)
    want = build_route_list_ref(ids, E, BM, keep, cap, max_kept)
    got = build_route_list(ids, E, BM, keep, cap, max_kept)  # auto: the kernels on CUDA
    _assert_same(got, want)
    cpu = build_route_list_ref(ids.cpu(), E, BM, None if keep is None else keep.cpu(), cap,
                               max_kept)
    _assert_same(got, cpu._replace(**{n: getattr(cpu, n).to(DEV) for n in cpu._fields[:-1]}))


def test_sync_free_and_independent_of_stale_memory():
    ids, keep, cap, _ = _dispatch("zipf", 1024, 8, 128, "capacity")
    want = build_route_list_ref(ids, 128, 64, keep, cap)
    build_route_list(ids, 128, 64, keep, cap)  # compile outside the check
    torch.full((1 << 24,), -7, dtype=torch.int32, device=DEV)  # freed: the next buffers reuse it
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = build_route_list(ids, 128, 64, keep, cap)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _assert_same(got, want)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_cuda_graph_replay_with_new_routing(mode):
    T, k, E, BM = 1024, 8, 128, 64
    ids, keep, cap, _ = _dispatch("uniform", T, k, E, mode)
    static_ids = ids.clone()
    static_keep = None if keep is None else keep.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        build_route_list(static_ids, E, BM, static_keep, cap)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = build_route_list(static_ids, E, BM, static_keep, cap)
    for i, kind in enumerate(["zipf", "one_expert", "sparse_experts", "uniform"]):
        nids, nkeep, _, _ = _dispatch(kind, T, k, E, mode, seed=50 + i)
        static_ids.copy_(nids)
        if nkeep is not None:
            static_keep.copy_(nkeep)
        graph.replay()
        _assert_same(static_out, build_route_list_ref(nids, E, BM, nkeep, cap))


@pytest.mark.parametrize("T,E", [(1024, 128), (32768, 128)])
def test_report_timing_against_the_sort(T, E, capsys):
    """Not a gate: prints the graphed time of both builds (values are checked above)."""
    ids, _, _, _ = _dispatch("uniform", T, 8, E, "dropless")
    times = {}
    for impl in ("reference", "triton"):
        build_route_list(ids, E, 128, impl=impl)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                build_route_list(ids, E, 128, impl=impl)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times[impl] = start.elapsed_time(end) / 20
    with capsys.disabled():
        print(f"\nroute list N={T * 8} E={E}: sort {times['reference'] * 1e3:.1f} us, "
              f"counting sort {times['triton'] * 1e3:.1f} us")
    assert all(t > 0 for t in times.values())
