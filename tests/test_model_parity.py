"""moegraph's eager model against transformers' Qwen3MoeForCausalLM on checkpoints written by
`moegraph init`: fp32 logits, loss and aux loss to 1e-4."""

import pytest
import torch
from typer.testing import CliRunner

from moegraph_cli.app import app
from moegraph_cli.models import MoeCausalLM

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "tiny": ["run.dtype=float32"],
    "dense-layer-unnormalised-sharded": ["run.dtype=float32", "model.mlp_only_layers=[0]",
                                         "model.norm_topk_prob=false"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_init_checkpoint_matches_transformers(tmp_path, variant):
    args = ["init", "tiny-qwen3-moe", str(tmp_path / "ckpt"), "--seed", "7"]
    for s in VARIANTS[variant]:
        args += ["--set", s]
    if "sharded" in variant:
        args += ["--max-shard-size", "8MB"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    if "sharded" in variant:
        assert "model.safetensors.index.json" in files and len(files) > 3
    ours = MoeCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32, attn_implementation="sdpa").eval()
    if "dense" in variant:
        assert not ours.layers[0].is_moe and ours.layers[1].is_moe
        assert not ours.config.norm_topk_prob
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(ids, labels=ids)
        b = theirs(ids, labels=ids, output_router_logits=True)
    assert (a.logits - b.logits).abs().max().item() <= 1e-4
    assert abs(a.loss.item() - b.loss.item()) <= 1e-4
    assert abs(a.aux_loss.item() - b.aux_loss.item()) <= 1e-4
    assert a.aux_loss.item() > 0.5  # a real statistic, not a zero


def test_from_profile_is_seeded():
    a = MoeCausalLM.from_profile("tiny-qwen3-moe", seed=3, overrides=["model.vocab_size=64"])
    b = MoeCausalLM.from_profile("tiny-qwen3-moe", seed=3, overrides=["model.vocab_size=64"])
    c = MoeCausalLM.from_profile("tiny-qwen3-moe", seed=4, overrides=["model.vocab_size=64"])
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.moe.w_gate_up"], sc["layers.0.moe.w_gate_up"])
    assert a.layers[0].moe.w_gate_up.dtype == torch.bfloat16
