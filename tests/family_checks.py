"""The checks every architecture family passes (tests/models/test_<family>.py call them).

- `check_hf_checkpoint`: transformers builds the model from a config with non-default fields,
  every weight (norms too, and saved buffers such as a router's correction bias) is randomised, `save_pretrained` writes it sharded; it loads through
  `moegraph_cli.models.from_pretrained`, fp32 logits, loss and aux loss match transformers'
  within 1e-4, and saving it again gives every tensor back bit for bit.
- `check_init_checkpoint`: a checkpoint written by `moegraph init` loads in transformers with
  the same logits, loss and aux loss, and loading and saving it again gives identical files.
- `check_emulated_lr0`: eager vs attn+moe graphs (the emulated backend) at lr 0, losses and
  every gradient bitwise equal, every scope captured and replayed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from moegraph_cli import models
from moegraph_cli.commands.reference_check import honour_config
from moegraph_cli.io.checkpoint_save import save_checkpoint
from moegraph_cli.graphs import GraphSession
from moegraph_cli.graphs.backend import EmulatedGraphs
from moegraph_cli.train.harness import GraphTrainer, scope_specs
from moegraph_cli.train.trainer import batches

from cli_util import run_cli

TOL = 1e-4
# CPU-small shapes for any tiny-* profile (a family's own fields come on top).
SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=3", "run.dtype=float32"]


def _ids(vocab: int, seq: int = 48) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def assert_parity(ours, theirs, vocab: int, seq: int = 48) -> None:
    honour_config(theirs)  # GPT-OSS's swiglu fields, where transformers ignores them
    ids = _ids(vocab, seq)
    with torch.no_grad():
        a = ours(ids, labels=ids)
        b = theirs(ids, labels=ids, output_router_logits=True)
    assert (a.logits - b.logits).abs().max().item() <= TOL
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    # transformers' class has no aux loss (DeepSeek-V3; 5.17's output has no such field at
    # all, 5.25's holds None): nor has ours
    if getattr(b, "aux_loss", None) is None:
        assert ours.config.router_aux_loss_coef == 0
        return
    assert abs(a.aux_loss.item() - b.aux_loss.item()) <= TOL
    assert a.aux_loss.item() > 0.5  # a real statistic, not a zero


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def check_hf_checkpoint(tmp_path: Path, hf_config, seed: int = 0, attn: str = "sdpa"):
    """See the module docstring; returns moegraph's model for family-specific asserts.
    `attn`: transformers' attention implementation (GPT-OSS has no SDPA one: "eager")."""
    import transformers

    torch.manual_seed(seed)
    hf_class = getattr(transformers, hf_config.architectures[0])
    theirs = hf_class(hf_config).float().eval()
    with torch.no_grad():
        for p in theirs.parameters():  # norms too, so a misplaced norm weight shows
            p.add_(torch.randn_like(p) * 0.05)
        params = {n for n, _ in theirs.named_parameters()}
        for n, t in theirs.state_dict().items():  # buffers saved with the weights too
            if n not in params and t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.05)
    src = tmp_path / "hf"
    theirs.save_pretrained(src, max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").is_file()
    assert len(list(src.glob("*.safetensors"))) > 2
    theirs = hf_class.from_pretrained(src, dtype=torch.float32,
                                      attn_implementation=attn).eval()
    ours = models.from_pretrained(src, dtype=torch.float32)
    assert ours.config.model_type == hf_config.model_type
    assert_parity(ours, theirs, hf_config.vocab_size)

    out = tmp_path / "again"
    save_checkpoint(ours.state_dict(), ours.config, out)
    hf_tensors, again = _tensors(src), _tensors(out)
    if ours.config.tie_word_embeddings:
        hf_tensors.pop("lm_head.weight", None)
    assert sorted(again) == sorted(hf_tensors)
    for k, t in hf_tensors.items():
        assert torch.equal(t.view(torch.uint8), again[k].view(torch.uint8)), k
    return ours


def check_init_checkpoint(tmp_path: Path, profile: str, overrides=(), hf_kwargs=None,
                          attn: str = "sdpa"):
    import transformers

    ckpt = tmp_path / "init"
    args = ["init", profile, ckpt, "--seed", "7", "--max-shard-size", "60KB"]
    for s in [*SMALL, *overrides]:
        args += ["--set", s]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert (ckpt / "model.safetensors.index.json").is_file()
    ours = models.from_pretrained(ckpt, dtype=torch.float32)
    hf_class = getattr(transformers, ours.config.family.architecture)
    theirs = hf_class.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=attn,
                                      **(hf_kwargs or {})).eval()
    assert_parity(ours, theirs, ours.config.vocab_size)

    again = tmp_path / "again"
    save_checkpoint(ours.state_dict(), ours.config, again, max_shard_bytes=60_000)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (ckpt / name).read_bytes() == (again / name).read_bytes(), name
    return ours, theirs


def check_emulated_lr0(profile: str, overrides=(), strategy: str = "shared") -> None:
    def build():
        return models.from_profile(profile, dtype=torch.float32,
                                   overrides=[*SMALL, *overrides])

    eager, graphed = build(), build()
    te, tg = GraphTrainer(eager, lr=0.0), GraphTrainer(graphed, lr=0.0)
    session = GraphSession(scope_specs(graphed, ["attn", "moe"]), strategy=strategy,
                           backend=EmulatedGraphs(), warmup_iters=1)
    ids = next(batches(128, 2, 16, 0, "cpu"))
    session.record(lambda: graphed(ids, labels=ids))
    assert session.capture(), session.failure
    session.install()
    tg.session = session
    ie, ig = batches(128, 2, 16, 1, "cpu"), batches(128, 2, 16, 1, "cpu")
    for _ in range(3):
        le, lg = te.step(next(ie)), tg.step(next(ig))
        assert le.item() == lg.item()
        for (n, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
            assert torch.equal(a.grad, b.grad), n
            assert a.grad.abs().sum() > 0 or "norm" in n, n  # every parameter is trained
    tot = session.stats()["totals"]
    n = len(session.scopes)
    assert n == 2 * graphed.config.num_hidden_layers
    assert tot["captured"] == n and tot["replayed"] == 3 * n and tot["fallback"] == 0
