"""The planner's choice of loss head: the logits whole, or loss_chunked.py's row chunks.

With `run.loss_chunk: auto` a plan may run the head in chunks of AUTO_ROWS rows: it then holds
one chunk's logits and dx and dW [V, H] instead of all the logits [T, V] (scope_memory's
tail_memory). The planner prices both heads and takes the one whose plan saves the most time
net of what it costs, so chunks come only where they pay: where the whole logits would push a
layer out of its graph or into recompute. A forced `run.loss_chunk` (0 or N rows) is the only
option.

The chunked head's extra time (an estimate): one more pass over dW and dx in its backward (the
scale by the incoming gradient: read and write, 2 * b * (V + T) * H bytes, at an effective
SCALE_BYTES_PER_S) and four launches a chunk beyond the first (the GEMMs and both loss kernels,
at costs.LAUNCH_US each, where the head runs eagerly). SCALE_BYTES_PER_S is set from one
measurement: on the 4-layer Qwen3-30B at 4 x 4096 (an H100, torch 2.11;
benchmarks/results/whole_step_loss_chunk_*.json) chunks of 2048 rows added 1.34 ms to the
eager step's `other` part and 1.46 ms to the step graph's, for 1.38 GB of scale traffic.
"""

from __future__ import annotations

import dataclasses

from ..report.summary import DTYPE_BYTES
from .costs import LAUNCH_US
from .scope_memory import loss_chunk_of, tail_memory
from .simulation import StepModel

AUTO_ROWS = 2048
SCALE_BYTES_PER_S = 1.0e12  # effective: the measured cost over the scale pass's bytes
LAUNCHES_A_CHUNK = 4


def options(model: StepModel) -> list[tuple[int, float]]:
    """(rows, extra ms) of each head the plan may take: 0 rows is the logits whole."""
    prof = model.prof
    if prof.run.loss_chunk != "auto":
        rows = loss_chunk_of(prof)
        return [(rows, chunk_ms(model, rows))]
    T = prof.run.batch * prof.run.seq_len
    out = [(0, 0.0)]
    if T > AUTO_ROWS:
        out.append((AUTO_ROWS, chunk_ms(model, AUTO_ROWS)))
    return out


def chunk_ms(model: StepModel, rows: int) -> float:
    """The chunked head's extra time over the whole head's (module docstring)."""
    if rows <= 0:
        return 0.0
    c, run = model.prof.model, model.prof.run
    b, T = DTYPE_BYTES[run.dtype], run.batch * run.seq_len
    scale = 2 * b * (c.vocab_size + T) * c.hidden_size / SCALE_BYTES_PER_S * 1e3
    chunks = -(-T // min(rows, T))
    return scale + (chunks - 1) * LAUNCHES_A_CHUNK * LAUNCH_US / 1e3


def with_head(model: StepModel, rows: int) -> StepModel:
    """`model` with the loss head of `rows` rows a chunk (0: whole)."""
    tail = tail_memory(model.prof, sinks=model.parallel is None, device_type="cuda",
                       chunk_rows=rows)
    return dataclasses.replace(model, tail=tail)
