"""Training step: micro-batches' forward and backward, then one AdamW step; seeded synthetic or
file batches.

Gradients are written, not added (grads.py): every trainable parameter is a sink whose `.grad`
is a fixed view into the optimizer's flat gradient buffer (optim.FlatAdamW), the first
micro-batch's backward writes each gradient there and later micro-batches (`grad_accum` > 1)
add to it. There is no zeroing pass. With k micro-batches each micro-batch's loss is scaled by
1/k, so the gradients are those of the mean loss over the k micro-batches: for the token loss,
exactly those of one batch k times the size (every micro-batch has the same number of
predicted tokens); the load-balancing aux loss is the mean of the micro-batches' (as in
Megatron), not the aux loss of the pooled batch.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .. import grads
from ..errors import UsageError

if TYPE_CHECKING:
    from ..graphs import GraphSession


def synthetic_batch(vocab_size: int, batch: int, seq_len: int, seed: int, step: int,
                    device) -> torch.Tensor:
    """Token ids `[batch, seq_len]` for one step: the same (seed, step) always gives the same."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen, dtype=torch.long)
    return ids.to(device)


def load_token_file(path: str | Path) -> torch.Tensor:
    """A flat 1-D token id tensor from `.pt` (a saved integer tensor) or `.bin` (raw uint16,
    nanoGPT); one-line errors for anything else. The last file read is kept (verify and the
    input checks read it more than once)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"run.data: token file {path} does not exist")
    if not path.is_file():
        raise UsageError(f"run.data: {path} is not a regular file")
    if path.suffix not in (".pt", ".bin"):
        raise UsageError(f"run.data: {path} must be .pt (tensor of ids) or .bin (raw uint16 ids)")
    stat = path.stat()  # the cache key: a changed file is read again
    return _read_tokens(str(path.resolve()), (stat.st_ino, stat.st_mtime_ns, stat.st_size),
                        str(path))


@functools.lru_cache(maxsize=1)
def _read_tokens(resolved: str, _version: tuple, shown: str) -> torch.Tensor:
    try:
        if resolved.endswith(".bin"):
            raw = Path(resolved).read_bytes()
        elif not _torch_save_file(resolved):
            raise UsageError(f"run.data: {shown} is not a file written by torch.save (neither "
                             "a zip archive nor a pickle)")
        else:
            with warnings.catch_warnings():  # e.g. a pickle protocol note: not the user's error
                warnings.simplefilter("ignore")
                tokens = torch.load(resolved, map_location="cpu", weights_only=True)
    except OSError as e:
        raise UsageError(f"run.data: {shown} cannot be read ({e.strerror or type(e).__name__})"
                         ) from None
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load fails in many ways on a foreign file
        if "weights_only" in str(e):
            why = "it holds Python objects besides tensors; save a plain tensor of ids"
        else:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
        raise UsageError(f"run.data: {shown} cannot be loaded by torch.load ({why})") from None
    if resolved.endswith(".bin"):
        if len(raw) % 2:
            raise UsageError(f"run.data: {shown} has an odd byte count; expected raw uint16 ids")
        if not raw:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint16).long()
    if not isinstance(tokens, torch.Tensor) or tokens.layout != torch.strided \
            or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        got = f"a {tokens.dtype} tensor" if isinstance(tokens, torch.Tensor) else \
            f"a {type(tokens).__name__}"
        raise UsageError(f"run.data: {shown} must hold an integer tensor of token ids, not {got}")
    return tokens.reshape(-1).long()


def _torch_save_file(path: str) -> bool:
    """torch.save writes a zip archive (or, with the legacy format, a pickle: 0x80)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def check_token_file(path: str | Path, vocab_size: int, need: int) -> torch.Tensor:
    """The token ids of `path`, refused unless it has `need` tokens (one batch) and every id
    is in 0..vocab_size-1."""
    tokens = load_token_file(path)
    if tokens.numel() < need:
        raise UsageError(f"run.data: {path} has {tokens.numel()} tokens; one batch needs {need}")
    low, high = (int(x) for x in torch.aminmax(tokens))
    if low < 0:
        raise UsageError(f"run.data: {path} holds the negative token id {low}; token ids are "
                         f"0..{vocab_size - 1} (vocab_size {vocab_size})")
    if high >= vocab_size:
        raise UsageError(f"run.data: {path} holds token id {high} >= vocab_size {vocab_size}")
    return tokens


def batches(vocab_size: int, batch: int, seq_len: int, seed: int, device,
            data: str | None = None, fixed: bool = False, rank: int = 0,
            world: int = 1) -> Iterator[torch.Tensor]:
    """Endless batches; `fixed` repeats step 0's batch (for overfitting checks).

    Data parallel: `batch` sequences per rank; step s's global batch is the one a single
    process would draw with batch * world sequences, and rank r gets its rows
    [r * batch, (r + 1) * batch). So a run on N ranks sees the same tokens as one process."""
    if world > 1:
        for ids in batches(vocab_size, batch * world, seq_len, seed, "cpu", data, fixed):
            yield ids[rank * batch:(rank + 1) * batch].to(device)
        return
    tokens = check_token_file(data, vocab_size, batch * seq_len) if data else None
    step = 0
    while True:
        s = 0 if fixed else step
        if tokens is None:
            yield synthetic_batch(vocab_size, batch, seq_len, seed, s, device)
        else:
            start = (s * batch * seq_len) % (tokens.numel() - batch * seq_len + 1)
            yield tokens[start:start + batch * seq_len].view(batch, seq_len).to(device)
        step += 1


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0):
    """FlatAdamW over the trainable parameters: they and their `.grad` become views into flat
    buffers, and each becomes a gradient sink."""
    from .optim import FlatAdamW

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = FlatAdamW(params, lr=lr, weight_decay=weight_decay)
    for p in params:
        grads.sink(p)
    if any(p.is_cuda for p in params):
        # Packing held every parameter twice for a moment: give the cached copies back, so
        # they do not count in the run's reserved peak.
        torch.cuda.empty_cache()
    return optimizer


def allocate_grads(model: torch.nn.Module) -> None:
    """Give every parameter a zeroed `.grad` at a fixed address (kept for the whole run)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def split_micro(input_ids: torch.Tensor, grad_accum: int) -> tuple[torch.Tensor, ...]:
    """A step's [k * b, S] batch as k micro-batches of b sequences (views, no copy)."""
    if input_ids.shape[0] % grad_accum:
        raise UsageError(f"run.grad_accum {grad_accum} must divide the step's "
                         f"{input_ids.shape[0]} sequences")
    return input_ids.chunk(grad_accum, dim=0) if grad_accum > 1 else (input_ids,)


class Trainer:
    """One optimizer step per call over `grad_accum` micro-batches; the loss (the mean over
    the micro-batches) comes back as a device tensor (no host sync)."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                 grad_accum: int = 1):
        self.model = model
        self.grad_accum = grad_accum
        self.optimizer = make_optimizer(model, lr, weight_decay)
        # DeepSeek-V3's router-bias rule (moe.bias_update_rate), applied after each step
        self.bias_update = getattr(getattr(model, "moe_config", None), "bias_update_rate", 0) > 0

    def forward_backward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Every micro-batch's forward and backward; the gradients are in `.grad` after."""
        total = None
        for i, ids in enumerate(split_micro(input_ids, self.grad_accum)):
            self.before_forward()
            loss = self.model(ids, labels=ids, keep_logits=False).loss
            if self.grad_accum > 1:
                loss = loss / self.grad_accum
            with grads.backward_pass(accumulate=i > 0):
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def before_forward(self) -> None:
        """Called before each micro-batch's forward (a graph session re-arms here)."""

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(input_ids)
        self.optimizer.step()
        if self.bias_update:
            from ..models.common.ffn import update_router_bias_

            update_router_bias_(self.model)
        return loss


def train(model: torch.nn.Module, batch_iter: Iterator[torch.Tensor], steps: int, lr: float,
          weight_decay: float = 0.0,
          on_step: Callable[[int, torch.Tensor], None] | None = None,
          grad_accum: int = 1) -> list[float]:
    """Run `steps` optimizer steps; returns the per-step losses."""
    trainer = Trainer(model, lr, weight_decay, grad_accum)
    losses = []
    for i in range(steps):
        loss = trainer.step(next(batch_iter))
        losses.append(loss)
        if on_step is not None:
            on_step(i, loss)
    return [float(x) for x in torch.stack(losses).cpu()]


class GraphTrainer(Trainer):
    """A Trainer whose micro-batches re-arm an installed graph session (one replay each)."""

    def __init__(self, model, lr: float, weight_decay: float = 0.0, grad_accum: int = 1):
        super().__init__(model, lr, weight_decay, grad_accum)
        self.session: GraphSession | None = None

    def before_forward(self) -> None:
        if self.session is not None:
            self.session.new_step()

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.session is not None and self.session.whole_step:
            return self.session(input_ids)[0]
        return super().step(input_ids)
