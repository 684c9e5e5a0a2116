"""RouteList construction against a plain-Python oracle, in dropless and capacity modes."""

import pytest
import torch
from routing_cases import make_routing

from moegraph_cli.moe.routing import capacity_keep_TK, expert_capacity
from moegraph_kernels.route_align import build_route_list, num_slots


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


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0, 1.25])
@pytest.mark.parametrize("kind,T,k,E,BM", CASES)
def test_route_list_matches_oracle(kind, T, k, E, BM, capacity_factor):
    ids, w = make_routing(kind, T, k, E, seed=T + k + E)
    keep, cap = None, None
    if capacity_factor is not None:
        cap = expert_capacity(T, k, E, capacity_factor)
        keep = capacity_keep_TK(ids, w, E, cap)
    rl = build_route_list(ids, E, BM, keep, cap)
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


def test_capacity_drops_lowest_weight_and_higher_token_on_ties():
    # Expert 0 gets four routes of equal weight and capacity 2: tokens 0 and 1 keep theirs.
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    w = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    keep = capacity_keep_TK(ids, w, 4, 2)
    rl = build_route_list(ids, 4, 4, keep, 2)
    assert rl.token_slots[:, 0].tolist() == [0, 1, -1, -1]
    assert int(rl.num_dropped) == 2
    # A strictly heavier route wins over a lower token.
    w[3, 0] = 0.9
    keep = capacity_keep_TK(ids, w, 4, 2)
    rl = build_route_list(ids, 4, 4, keep, 2)
    assert rl.token_slots[:, 0].tolist() == [0, -1, -1, 1]
    assert rl.slot_token[:4].tolist() == [0, 3, 4, 4]


def test_padding_slots_carry_sentinels_and_real_slots_are_a_bijection():
    T, k, E, BM = 37, 3, 6, 8
    ids, _ = make_routing("zipf", T, k, E, seed=3)
    rl = build_route_list(ids, E, BM)
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
