"""Training step: forward, backward, AdamW (fused on CUDA); seeded synthetic or file batches.

Gradients live in fixed `.grad` buffers, allocated once and zeroed in place each step
(`zero_grad(set_to_none=False)`). Eager and graphed steps therefore accumulate into the same
storage the same way (0 + g), and a captured backward graph can add into `.grad` directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import torch

from .errors import UsageError


def synthetic_batch(vocab_size: int, batch: int, seq_len: int, seed: int, step: int,
                    device) -> torch.Tensor:
    """Token ids `[batch, seq_len]` for one step: the same (seed, step) always gives the same."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen, dtype=torch.long)
    return ids.to(device)


def load_token_file(path: str | Path) -> torch.Tensor:
    """A flat 1-D token id tensor from `.pt` (a saved tensor) or `.bin` (raw uint16, nanoGPT)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"run.data: token file {path} does not exist")
    if path.suffix == ".pt":
        tokens = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point():
            raise UsageError(f"run.data: {path} must hold an integer tensor of token ids")
        return tokens.reshape(-1).long()
    if path.suffix == ".bin":
        raw = path.read_bytes()
        if len(raw) % 2:
            raise UsageError(f"run.data: {path} has an odd byte count; expected raw uint16 ids")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint16).long()
    raise UsageError(f"run.data: {path} must be .pt (tensor of ids) or .bin (raw uint16 ids)")


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
    tokens = load_token_file(data) if data else None
    if tokens is not None:
        need = batch * seq_len
        if tokens.numel() < need:
            raise UsageError(f"run.data: {data} has {tokens.numel()} tokens; one batch needs {need}")
        if int(tokens.max()) >= vocab_size:
            raise UsageError(f"run.data: {data} holds token id {int(tokens.max())} >= vocab_size "
                             f"{vocab_size}")
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
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params) and len(params) > 0
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def allocate_grads(model: torch.nn.Module) -> None:
    """Give every parameter a zeroed `.grad` at a fixed address (kept for the whole run)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


class Trainer:
    """One optimizer step per call; the loss comes back as a device tensor (no host sync)."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0):
        self.model = model
        self.optimizer = make_optimizer(model, lr, weight_decay)
        allocate_grads(model)

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=False)
        out = self.model(input_ids, labels=input_ids)
        out.loss.backward()
        self.optimizer.step()
        return out.loss.detach()


def train(model: torch.nn.Module, batch_iter: Iterator[torch.Tensor], steps: int, lr: float,
          weight_decay: float = 0.0,
          on_step: Callable[[int, torch.Tensor], None] | None = None) -> list[float]:
    """Run `steps` optimizer steps; returns the per-step losses."""
    trainer = Trainer(model, lr, weight_decay)
    losses = []
    for i in range(steps):
        loss = trainer.step(next(batch_iter))
        losses.append(loss)
        if on_step is not None:
            on_step(i, loss)
    return [float(x) for x in torch.stack(losses).cpu()]
