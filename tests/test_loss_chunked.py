"""The loss-only head in row chunks (models/common/loss_chunked.py) against
F.cross_entropy(F.linear(x, w).float(), labels) and against loss.linear_cross_entropy (one
chunk of every row: bitwise), both kernel paths (Triton under the interpreter on CPU, fp32
only there, and the pure-torch one); sinks written and accumulated; the model's run.loss_chunk
and the plan field that sets it.
"""

import pytest
import torch
import torch.nn.functional as F

from moegraph_cli import grads
from moegraph_cli.config import load_profile
from moegraph_cli.errors import UsageError
from moegraph_cli.models.common.loss import linear_cross_entropy
from moegraph_cli.models.common.loss_chunked import chunked_linear_cross_entropy
from moegraph_cli.train.runspec import loss_chunk_rows

from test_loss import _case, _close, _reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = [True, False]


def _chunked(x, w, labels, rows, use_triton, grad_scale=1.0):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(x, w, labels, rows, use_triton=use_triton)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and loss.requires_grad
    dx, dw = torch.autograd.grad(loss * grad_scale, [x, w])
    return loss.detach(), dx, dw


@pytest.mark.parametrize("rows", [1, 4, 7, 64])
@pytest.mark.parametrize("T,V", [(1, 5), (13, 100), (33, 257)])
@pytest.mark.parametrize("use_triton", TRITON)
def test_matches_torch_cross_entropy(use_triton, T, V, rows):
    x, w, labels = _case(T, V, seed=T * 100 + V)
    for scale in (1.0, 0.375):
        got = _chunked(x, w, labels, rows, use_triton, scale)
        want = _reference(x, w, labels, scale)
        for name, g, r in zip(("loss", "dx", "dw"), got, (want[0], want[2], want[3])):
            _close(g, r, f"{name} (rows {rows}, scale {scale})")


@pytest.mark.parametrize("use_triton", TRITON)
def test_one_chunk_is_the_unchunked_head_bitwise(use_triton):
    """rows >= T: the same GEMMs and kernels as linear_cross_entropy, so the same bits."""
    x, w, labels = _case(29, 211, seed=3)
    impl = "triton" if use_triton else "reference"
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss_a, _ = linear_cross_entropy(xa, wa, labels, impl=impl, inplace_backward=True)
    want = (loss_a.detach(), *torch.autograd.grad(loss_a, [xa, wa]))
    for rows in (29, 1000):
        got = _chunked(x, w, labels, rows, use_triton)
        for name, g, r in zip(("loss", "dx", "dw"), got, want):
            assert torch.equal(g, r), f"{name} differs at rows {rows}"


@pytest.mark.parametrize("use_triton", TRITON)
def test_every_label_ignored_is_nan_as_torch(use_triton):
    x, w, labels = _case(9, 40, seed=5)
    labels[:] = -100
    loss, dx, dw = _chunked(x, w, labels, 4, use_triton)
    assert torch.isnan(loss)
    want = F.cross_entropy(F.linear(x, w), labels, ignore_index=-100)
    assert torch.isnan(want)


def test_sink_written_then_accumulated():
    """A sink weight: the first backward writes scale * dW into .grad, an accumulating one
    adds it; autograd gets None for it."""
    x, w, labels = _case(17, 60, seed=7)
    _, _, dw = _chunked(x, w, labels, 5, False, 0.5)
    p = torch.nn.Parameter(w.clone())
    p.grad = torch.full_like(w, float("nan"))  # a write must not read what was there
    grads.sink(p)
    for accumulate, want in ((False, dw), (True, 2 * dw)):
        loss = chunked_linear_cross_entropy(x, p, labels, 5, use_triton=False)
        with grads.backward_pass(accumulate):
            (loss * 0.5).backward()
        _close(p.grad, want, f"sink grad (accumulate={accumulate})")


def test_no_grad_forward_is_the_loss_alone():
    x, w, labels = _case(21, 90, seed=9)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(x, w, labels, 8, use_triton=False)
    _close(loss, _reference(x, w, labels)[0], "loss")


def test_backward_twice_is_refused():
    x, w, labels = _case(6, 30, seed=11)
    x = x.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(x, w, labels, 4, use_triton=False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_rows_must_be_positive():
    x, w, labels = _case(4, 10)
    with pytest.raises(ValueError, match="rows must be positive"):
        chunked_linear_cross_entropy(x, w, labels, 0, use_triton=False)


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_chunk_trains_like_the_whole_head(tied):
    """The tiny model with loss_chunk against the whole head: the same loss and gradients to
    rounding (fp32), the trainers' keep_logits=False; a tied head's weight gets both its
    uses' gradients."""
    from moegraph_cli.models import MoeCausalLM

    over = ["model.tie_word_embeddings=true"] if tied else []
    prof = load_profile("tiny-qwen3-moe", over)
    ids = torch.randint(0, prof.model.vocab_size, (2, 24), generator=torch.Generator()
                        .manual_seed(0))
    out = {}
    for chunk in (0, 16):
        model = MoeCausalLM.from_config(prof.model, prof.moe, 0, "float32")
        model.loss_chunk = chunk
        res = model(ids, labels=ids, keep_logits=False)
        assert res.logits is None
        res.loss.backward()
        out[chunk] = (res.loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    _close(out[16][0], out[0][0], "loss")
    for name, g in out[0][1].items():
        _close(out[16][1][name], g, name)


def test_run_loss_chunk_setting():
    assert load_profile("tiny-qwen3-moe").run.loss_chunk == "auto"
    assert load_profile("tiny-qwen3-moe", ["run.loss_chunk=4096"]).run.loss_chunk == 4096
    assert loss_chunk_rows("auto") == 0 and loss_chunk_rows(0) == 0
    assert loss_chunk_rows(512) == 512
    for bad in ("-1", "abc", "1.5"):
        with pytest.raises(UsageError, match="run.loss_chunk"):
            load_profile("tiny-qwen3-moe", [f"run.loss_chunk={bad}"])
