"""Routing generators shared by the kernel tests: each returns (topk_ids_TK, topk_weights_TK).

Every token routes to k distinct experts, as a top-k router does.
"""

from __future__ import annotations

import torch


def uniform(T, k, E, gen):
    probs = torch.softmax(torch.randn(T, E, generator=gen), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    return ids, w


def zipf(T, k, E, gen, s=1.5):
    """Skewed load: expert i is picked with weight 1 / (i + 1)^s, without replacement."""
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    ids = torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)
    w = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    return ids, w


def one_expert(T, k, E, gen):
    """Every token routes to expert 0 (and, if k > 1, to experts 1..k-1); the rest get none."""
    ids = torch.arange(k).expand(T, k).clone()
    w = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    return ids, w


def sparse_experts(T, k, E, gen):
    """Only the odd experts get routes: the even ones are empty."""
    used = torch.arange(1, E, 2)
    perm = torch.argsort(torch.rand(T, used.numel(), generator=gen), dim=-1)[:, :k]
    ids = used[perm]
    w = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    return ids, w


def tied_weights(T, k, E, gen):
    """Few distinct weight values and a hot expert: capacity ties must break to lower tokens."""
    ids, _ = zipf(T, k, E, gen, s=2.0)
    w = torch.randint(1, 4, (T, k), generator=gen).float() / 4
    return ids, w


ROUTINGS = {"uniform": uniform, "zipf": zipf, "one_expert": one_expert,
            "sparse_experts": sparse_experts, "tied_weights": tied_weights}


def make_routing(kind, T, k, E, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids, w = ROUTINGS[kind](T, k, E, gen)
    return ids.long().contiguous(), w.float().contiguous()


def moe_inputs(kind, T, k, E, H, F, seed=0):
    """(x, topk_ids, topk_weights, w_gate_up, w_down, dout) on the CPU in fp32, for a routing
    kind; weights scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    ids, w = make_routing(kind, T, k, E, seed=seed)
    x = torch.randn(T, H, generator=gen)
    w_gate_up = torch.randn(E, 2 * F, H, generator=gen) * H ** -0.5
    w_down = torch.randn(E, H, F, generator=gen) * F ** -0.5
    dout = torch.randn(T, H, generator=gen)
    return x, ids, w, w_gate_up, w_down, dout
