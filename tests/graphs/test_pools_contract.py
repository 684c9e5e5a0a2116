import pytest
import torch

from moegraph_cli.graphs import Contract, capture_order, group_names


def test_capture_order_is_replay_order():
    assert capture_order(3) == [("fwd", 0), ("fwd", 1), ("fwd", 2),
                                ("bwd", 2), ("bwd", 1), ("bwd", 0)]


def test_group_names_per_strategy():
    names, kinds = ["l0.attn", "l0.moe", "l1.attn", "l1.moe"], ["attn", "moe", "attn", "moe"]
    assert group_names(names, kinds, "shared") == ["shared"] * 4
    assert group_names(names, kinds, "per_scope") == ["attn", "moe", "attn", "moe"]
    assert group_names(names, kinds, "per_entry") == [None] * 4
    assert group_names(names, kinds, "x", {"l0.attn": "a", "l1.moe": None}) == \
        ["a", None, None, None]
    with pytest.raises(ValueError, match="unknown pool strategy"):
        group_names(names, kinds, "pooled")


def test_contract_reports_each_violation():
    lin = torch.nn.Linear(4, 4)
    lin.weight.grad = torch.zeros_like(lin.weight)
    lin.bias.grad = torch.zeros_like(lin.bias)
    x = torch.randn(2, 4, requires_grad=True)
    c = Contract.capture(lin, [x], list(lin.parameters()))
    params = list(lin.parameters())
    assert c.check(lin, (x,), params) is None
    assert c.check(lin, (torch.randn(3, 4, requires_grad=True),), params) == \
        "input 0 shape [3, 4] != captured [2, 4]"
    assert c.check(lin, (x.double(),), params).startswith("input 0 dtype torch.float64")
    assert c.check(lin, (x.detach(),), params) == "input 0 requires_grad False != captured True"
    assert c.check(lin, (torch.randn(4, 2).t().requires_grad_(),), params).startswith(
        "input 0 stride [1, 2] != captured [4, 1]")
    assert c.check(lin, (x, x), params) == "2 inputs != captured 1"
    lin.eval()
    assert c.check(lin, (x,), params) == "training mode False != captured True"
    lin.train()
    with torch.no_grad():
        assert c.check(lin, (x,), params) == "grad mode disabled (captured with grad enabled)"
    lin.bias.grad = torch.zeros_like(lin.bias)
    assert "parameter 1 .grad buffer moved" in c.check(lin, (x,), params)
