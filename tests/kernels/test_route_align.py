"""RouteList construction against a plain-Python oracle, in dropless and capacity modes; the
counting-sort kernels (interpreter) against the torch reference (stable sort), bit for bit."""

import pytest
import torch
from routing_cases import make_routing

from moegraph_cli.moe.routing import capacity_keep_TK, expert_capacity
from moegraph_kernels.route_align import build_route_list, build_route_list_ref, num_slots

IMPLS = ["reference", "triton"]


def oracle(ids_TK, w_TK, E, BM, capacity):
    """Loop-by-loop RouteList: per expert, its kept routes in route order, padded to BM."""
    T, k = ids_TK.shape
    N = T * k
    ids = ids_TK.reshape(-1).tolist()
    w = w_TK.reshape(-1).tolist()
    S = num_slots(N, E, BM, capacity)
    slot_token, slot_route = [T] * S, [N] * S
    token_slots, counts, starts = [-1] * N, [], []
    live_blocks = []
    start = 0
    for e in range(E):
        mine = [r for r in range(N) if ids[r] == e]
        if capacity is not None:
            # Highest weight first; ties to the lower token (route id grows with the token).
            mine = sorted(sorted(mine, key=lambda r: (-w[r], r))[:capacity])
        counts.append(len(mine))
        starts.append(start)
        for rank, r in enumerate(mine):
            slot_token[start + rank], slot_route[start + rank] = r // k, r
            token_slots[r] = start + rank
        padded = -(-len(mine) // BM) * BM
        live_blocks += [(start // BM + b, e) for b in range(padded // BM)]
        start += padded if capacity is None else -(-capacity // BM) * BM
    block_expert = [-1] * (S // BM)
    for b, e in live_blocks:
        block_expert[b] = e
    num_padded = sum(-(-c // BM) * BM for c in counts)
    return dict(slot_token=slot_token, slot_route=slot_route, block_expert=block_expert,
                token_slots=token_slots, expert_counts=counts, expert_starts=starts,
                num_padded=[num_padded], num_dropped=[N - sum(counts)])


CASES = [  # (routing, T, k, E, BM)
    ("uniform", 40, 2, 8, 16),
    ("zipf", 64, 4, 7, 16),
    ("one_expert", 33, 1, 5, 16),
    ("one_expert", 20, 3, 5, 8),
    ("sparse_experts", 30, 2, 9, 16),
    ("uniform", 1, 2, 4, 16),
    ("uniform", 12, 5, 5, 4),  # k == E
    ("tied_weights", 50, 3, 11, 8),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0, 1.25])
@pytest.mark.parametrize("kind,T,k,E,BM", CASES)
def test_route_list_matches_oracle(kind, T, k, E, BM, capacity_factor, impl):
    ids, w = make_routing(kind, T, k, E, seed=T + k + E)
    keep, cap = None, None
    if capacity_factor is not None:
        cap = expert_capacity(T, k, E, capacity_factor)
        keep = capacity_keep_TK(ids, w, E, cap)
    rl = build_route_list(ids, E, BM, keep, cap, impl=impl)
    want = oracle(ids, w, E, BM, cap)
    for name, expected in want.items():
        got = getattr(rl, name)
        assert got.dtype == torch.int32, name
        assert got.reshape(-1).tolist() == expected, name
    assert rl.token_slots.shape == (T, k)
    assert rl.num_slots == num_slots(T * k, E, BM, cap)
    if cap is None:
        assert rl.num_slots == (-(-T * k // BM) + E) * BM
        assert int(rl.num_dropped) == 0
    else:
        assert rl.num_slots == E * (-(-cap // BM) * BM)
        # The oracle's own tie rule and routing.capacity_keep_TK agree on what is dropped.
        assert torch.equal(rl.token_slots >= 0, keep)


@pytest.mark.parametrize("impl", IMPLS)
def test_capacity_drops_lowest_weight_and_higher_token_on_ties(impl):
    # Expert 0 gets four routes of equal weight and capacity 2: tokens 0 and 1 keep theirs.
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    w = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    keep = capacity_keep_TK(ids, w, 4, 2)
    rl = build_route_list(ids, 4, 4, keep, 2, impl=impl)
    assert rl.token_slots[:, 0].tolist() == [0, 1, -1, -1]
    assert int(rl.num_dropped) == 2
    # A strictly heavier route wins over a lower token.
    w[3, 0] = 0.9
    keep = capacity_keep_TK(ids, w, 4, 2)
    rl = build_route_list(ids, 4, 4, keep, 2, impl=impl)
    assert rl.token_slots[:, 0].tolist() == [0, -1, -1, 1]
    assert rl.slot_token[:4].tolist() == [0, 3, 4, 4]


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_slots_carry_sentinels_and_real_slots_are_a_bijection(impl):
    T, k, E, BM = 37, 3, 6, 8
    ids, _ = make_routing("zipf", T, k, E, seed=3)
    rl = build_route_list(ids, E, BM, impl=impl)
    real = rl.token_slots.reshape(-1).long()
    assert real.unique().numel() == T * k
    pad = torch.ones(rl.num_slots, dtype=torch.bool)
    pad[real] = False
    assert (rl.slot_token[pad] == T).all() and (rl.slot_route[pad] == T * k).all()
    assert (rl.slot_route[real] == torch.arange(T * k, dtype=torch.int32)).all()
    # Every slot of a live block belongs to that block's expert (or is padding).
    e_of_slot = rl.block_expert.repeat_interleave(BM)
    assert (e_of_slot[real].view(T, k) == ids.int()).all()
    assert (rl.block_expert[int(rl.num_padded) // BM:] == -1).all()
    assert (rl.block_expert[:int(rl.num_padded) // BM] >= 0).all()


def assert_same_route_list(got, want):
    """Every field equal: dtype, shape and each value (the slot order included)."""
    assert got.block_m == want.block_m
    for name in want._fields[:-1]:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


def _random_dispatch(gen, T, k, E, mode):
    """(ids, keep, capacity, max_kept) for a dispatch mode, with distinct experts per token."""
    ids = torch.argsort(torch.rand(T, E, generator=gen), dim=-1)[:, :k]
    if torch.rand(1, generator=gen).item() < 0.3:  # a hot expert: most tokens pick expert 0
        hot = (torch.rand(T, generator=gen) < 0.8) & ~(ids == 0).any(-1)
        ids[hot, 0] = 0
    w = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    if mode == "dropless":
        return ids, None, None, None
    if mode == "capacity":
        factor = [0.25, 0.5, 1.0, 2.0][int(torch.randint(4, (1,), generator=gen))]
        cap = expert_capacity(T, k, E, factor)
        return ids, capacity_keep_TK(ids, w, E, cap), cap, None
    keep = torch.rand(T, k, generator=gen) < 0.6  # dropless with a mask (expert parallelism)
    return ids, keep, None, int(keep.sum()) + int(torch.randint(3, (1,), generator=gen))


@pytest.mark.parametrize("mode", ["dropless", "capacity", "masked"])
def test_counting_sort_equals_stable_sort_on_random_cases(mode):
    """Sizes cross the interpreter's chunk (16 routes) and scan tile (4 chunks) bounds; E not
    a power of two, E above 16 (two expert lanes blocks), k == E, one token, BM not a power
    of two."""
    gen = torch.Generator().manual_seed({"dropless": 1, "capacity": 2, "masked": 3}[mode])
    sizes = [(1, 1, 1, 4), (1, 3, 3, 16), (5, 4, 4, 4), (17, 2, 3, 8), (33, 2, 7, 16),
             (64, 4, 13, 16), (70, 3, 24, 12), (96, 8, 40, 8), (129, 2, 5, 32),
             (50, 6, 67, 16), (200, 1, 2, 16), (31, 5, 5, 2)]
    for T, k, E, BM in sizes:
        ids, keep, cap, max_kept = _random_dispatch(gen, T, k, E, mode)
        want = build_route_list_ref(ids, E, BM, keep, cap, max_kept)
        got = build_route_list(ids, E, BM, keep, cap, max_kept, impl="triton")
        assert_same_route_list(got, want)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_counting_sort_every_route_to_one_expert_and_int32_ids(mode):
    T, k, E, BM = 45, 1, 9, 8
    ids = torch.full((T, k), 6, dtype=torch.int32)
    keep, cap = None, None
    if mode == "capacity":
        cap = 10
        keep = capacity_keep_TK(ids.long(), torch.ones(T, k), E, cap)
    want = build_route_list_ref(ids, E, BM, keep, cap)
    got = build_route_list(ids, E, BM, keep, cap, impl="triton")
    assert_same_route_list(got, want)
    assert got.expert_counts.tolist() == [0] * 6 + [T if cap is None else cap] + [0] * 2


def test_counting_sort_every_route_dropped():
    T, k, E, BM = 20, 2, 4, 8
    ids, _ = make_routing("uniform", T, k, E, seed=5)
    keep = torch.zeros(T, k, dtype=torch.bool)
    for cap, max_kept in [(3, None), (None, 0), (None, None)]:
        want = build_route_list_ref(ids, E, BM, keep, cap, max_kept)
        got = build_route_list(ids, E, BM, keep, cap, max_kept, impl="triton")
        assert_same_route_list(got, want)
        assert (got.token_slots == -1).all() and int(got.num_dropped) == T * k
        assert (got.block_expert == -1).all()


def test_unknown_impl_is_refused():
    ids, _ = make_routing("uniform", 4, 2, 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        build_route_list(ids, 4, 8, impl="cub")


@pytest.mark.parametrize("T,k,E", [(1, 1, 4), (37, 3, 16), (50, 8, 130), (64, 4, 1)])
def test_count_routes_matches_bincount_and_skips_out_of_range(T, k, E):
    """route_align.count_routes (the interpreter on CPU): per-expert counts as bincount
    gives, every route to one expert, ids outside [0, E) not counted."""
    from moegraph_kernels.route_align import count_routes
    g = torch.Generator().manual_seed(T * E)
    ids = torch.randint(0, E, (T, k), generator=g)
    assert torch.equal(count_routes(ids, E), torch.bincount(ids.reshape(-1), minlength=E).int())
    one = torch.full((T, k), E - 1)
    assert count_routes(one, E)[E - 1] == T * k and count_routes(one, E)[:E - 1].sum() == 0
    bad = ids.clone().reshape(-1)
    bad[0], bad[-1] = -1, E  # one route when T * k == 1: E wins
    want = torch.bincount(ids.reshape(-1), minlength=E).int()
    for i in {0, bad.numel() - 1}:
        want[ids.reshape(-1)[i]] -= 1
    assert torch.equal(count_routes(bad.view(T, k), E), want)


@pytest.mark.parametrize("block_c,block_eg,warps", [(4, 8, 1), (128, 16, 4), (1024, 16, 8)])
@pytest.mark.parametrize("num_chunks,E", [(1, 3), (37, 20), (300, 16)])
def test_chunk_scan_tile_changes_no_value(block_c, block_eg, warps, num_chunks, E):
    """The chunk scan (step 2) at the CPU's tile and at the tiles CUDA picks (one serial step
    up to 1024 chunks): each chunk's first rank per expert and the totals, as torch scans."""
    import triton

    from moegraph_kernels.fp_fusion import FUSED
    from moegraph_kernels.route_align import _chunk_bases_kernel
    g = torch.Generator().manual_seed(num_chunks * 7 + E)
    counts = torch.randint(0, 50, (num_chunks, E), generator=g, dtype=torch.int32)
    scanned = counts.clone()
    totals = torch.full((E,), -1, dtype=torch.int32)
    _chunk_bases_kernel[(triton.cdiv(E, block_eg),)](
        scanned, totals, num_chunks, E, BLOCK_C=block_c, BLOCK_EG=block_eg, num_warps=warps,
        enable_fp_fusion=FUSED)
    assert torch.equal(scanned, (counts.cumsum(0) - counts).to(torch.int32))
    assert torch.equal(totals, counts.sum(0).to(torch.int32))
