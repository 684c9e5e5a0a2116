"""Glue between the model, the trainer and the graph engine, shared by capture, verify and
profile: which scopes to graph, a trainer that re-arms the session every step, timed steps,
allocator peaks and the memory cap."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Iterator

import torch

from ..plan.capability import check_whole_step
from ..errors import NotCapturableError
from ..graphs import GraphSession, ScopeSpec
from ..graphs.step import StepGraph
from .trainer import GraphTrainer, Trainer, split_micro

# A requested scope name -> the model scope kinds it covers (a dense layer's MLP sits where
# the MoE block would, so `moe` covers it too).
SCOPE_KINDS = {"attn": {"attn"}, "moe": {"moe", "mlp"}}


def scope_specs(model, scopes: list[str], layer_scopes: dict[int, list[str]] | None = None
                ) -> list[ScopeSpec]:
    """The model's scopes to graph, in execution order. `layer_scopes` (from a plan) picks
    scopes per layer instead of the same `scopes` on every layer."""
    out = []
    for name, layer, kind, module in model.scopes():
        wanted = scopes if layer_scopes is None else layer_scopes.get(layer, [])
        if any(kind in SCOPE_KINDS[s] for s in wanted):
            out.append(ScopeSpec(name, layer, kind, module))
    return out


def build_session(model, scopes: list[str], pool: str, plan=None, rt=None,
                  grad_accum: int = 1, trainer=None):
    """A graph session over the model's scopes. Distributed (`rt`): FSDP2-sharded parameters
    are moving (graph inputs, never baked), decisions are agreed across ranks, and CUDA capture
    runs in thread_local mode (NCCL's watchdog thread keeps running); on the CPU the emulated
    backend stands in for CUDA graphs. `scopes == ["step"]`: the whole step of `trainer` as one
    graph (graphs/step.py)."""
    if "step" in scopes:
        return step_graph(trainer, rt)
    extra = {}
    if rt is not None:
        from ..distributed.model import is_sharded
        from ..graphs.backend import CudaGraphs, EmulatedGraphs

        backend = CudaGraphs("thread_local") if rt.device.type == "cuda" else EmulatedGraphs()
        extra = {"moving": lambda _name, p: is_sharded(p), "agree": rt.agree,
                 "backend": backend}
    extra["accumulate"] = grad_accum > 1
    if plan is not None:
        return GraphSession(scope_specs(model, scopes, plan.layer_scopes()),
                            groups=plan.scope_groups(), **extra)
    return GraphSession(scope_specs(model, scopes), strategy=pool, **extra)


def step_graph(trainer, rt=None) -> StepGraph:
    """The whole step of `trainer` (micro-batches' forward and backward, then the optimizer)
    as one graph; refused, with the reason, where it cannot be captured whole."""
    check_whole_step(1 if rt is None else rt.world)
    if trainer is None or not hasattr(trainer.optimizer, "warm_up"):
        raise NotCapturableError("--scopes step needs the flat AdamW (its learning rate and "
                                 "step count live on the device)")

    def warm_up(ids):
        Trainer.forward_backward(trainer, ids)  # writes the gradients: the next step rewrites
        trainer.optimizer.warm_up()  # compiles the update without applying it

    return StepGraph(lambda ids: (Trainer.step(trainer, ids),), warm_up)


def capture_into(model, session, input_ids: torch.Tensor, rt=None, grad_accum: int = 1
                 ) -> bool:
    """Record one forward (of one micro-batch), capture transactionally, install on success.
    Distributed: install only if every rank captured; a rank whose capture succeeded rolls
    back when another's failed, so all ranks go on eagerly together. A whole-step graph
    captures the step's whole batch."""
    if session.whole_step:
        ok = session.capture(input_ids)
        if ok:
            session.install()
        return ok
    micro = split_micro(input_ids, grad_accum)[0]
    session.record(lambda: model(micro, labels=micro))
    ok = session.capture()
    if rt is not None:
        everyone, reason = rt.all_ok(ok, session.failure)
        if ok and not everyone:
            session.rollback(f"another rank's capture failed ({reason})")
        ok = everyone
        if not ok and session.failure and not session.failure.startswith("rank"):
            session.failure = reason
    if ok:
        session.install()
    return ok




def make_trainer(model, lr: float, weight_decay: float = 0.0, rt=None,
                 grad_accum: int = 1) -> GraphTrainer:
    if rt is None:
        return GraphTrainer(model, lr, weight_decay, grad_accum)
    from ..distributed.trainer import DistTrainer
    return DistTrainer(model, lr, weight_decay, rt)


def dropped_routes(model, reset: bool = False) -> int:
    """Routes dropped by capacity since the last reset, over this process's MoE layers.
    `reset` also clears the routes the routers counted for their bias update
    (moe.bias_update_rate): warm-up and capture runs are no training steps."""
    total = 0
    for name, buf in model.named_buffers():
        if name.endswith("dropped_routes"):
            total += int(buf.sum())
            if reset:
                buf.zero_()
        elif reset and name.endswith("expert_load"):
            buf.zero_()
    return total


def timed_steps(trainer: Trainer, batch_iter: Iterator[torch.Tensor], steps: int,
                warmup: int = 0, on_step: Callable[[], None] | None = None) -> dict:
    """Run warm-up then timed steps; per-step ms from CUDA events (host clock on CPU)."""
    for _ in range(warmup):
        trainer.step(next(batch_iter))
        if on_step:
            on_step()
    cuda = torch.cuda.is_available() and next(trainer.model.parameters()).is_cuda
    times, losses = [], []
    for _ in range(steps):
        ids = next(batch_iter)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(trainer.step(ids))
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            losses.append(trainer.step(ids))
            times.append(time.perf_counter() - t0)
        if on_step:
            on_step()
    if cuda:
        torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in times]
    else:
        ms = [t * 1e3 for t in times]
    return {"step_ms": statistics.median(ms), "all_ms": ms,
            "losses": [float(x) for x in torch.stack(losses).cpu()] if losses else []}


def attn_moe_phase(model, trainer, it, steps: int, warmup: int, grad_accum: int,
                   step_ms: float) -> dict:
    """The whole-step graph's side-by-side partner: attn+moe graphs in one shared pool on the
    same model, trainer and batches, timed like any phase; `step_vs_attn_moe` is how much
    faster the whole step ran (its `step_ms`)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    session = build_session(model, ["attn", "moe"], "shared", grad_accum=grad_accum,
                            trainer=trainer)
    ok = capture_into(model, session, next(it), grad_accum=grad_accum)
    reset_peaks()
    trainer.session = session if ok else None
    timed = timed_steps(trainer, it, steps, warmup)
    timed.update(peaks())
    del timed["all_ms"]
    out = {"scopes": ["attn", "moe"], "pool": "shared", "captured_ok": ok,
           "failure": session.failure, "counters": session.stats()["totals"],
           "pools": session.pools(), **timed, "step_vs_attn_moe": timed["step_ms"] / step_ms}
    session.uninstall()
    trainer.session = None
    return out


def reset_peaks() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peaks() -> dict:
    if not torch.cuda.is_available():
        return {"peak_allocated": None, "peak_reserved": None}
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    return {"peak_allocated": int(s.get("allocated_bytes.all.peak", 0)),
            "peak_reserved": int(s.get("reserved_bytes.all.peak", 0))}


def set_memory_limit(limit_bytes: int | None, device: torch.device) -> dict | None:
    """Cap this process's allocator at `limit_bytes` (emulates a smaller GPU)."""
    if limit_bytes is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, limit_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return {"limit_bytes": limit_bytes, "device_bytes": total, "fraction": fraction}


def device_info() -> dict:
    import datetime

    import triton

    # str(): torch.__version__ is a str subclass that YAML and some JSON writers refuse.
    info = {"torch": str(torch.__version__), "triton": str(triton.__version__),
            "date": datetime.date.today().isoformat(), "gpu": None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    knobs = {k: os.environ[k] for k in KERNEL_KNOBS if k in os.environ}
    if knobs:  # a run with a kernel switched off or a tile overridden says so
        info["kernel_env"] = knobs
    return info


KERNEL_KNOBS = ("MOEGRAPH_FUSED", "MOEGRAPH_WGRAD_SHORT", "MOEGRAPH_COMBINE_TILE",
                "MOEGRAPH_FC1_TILE", "MOEGRAPH_FC2_TILE", "MOEGRAPH_FC1_TMA_STORE",
                "MOEGRAPH_FC1_PAIRED", "MOEGRAPH_WGRAD_PADDED", "MOEGRAPH_EAGER_EXPANDABLE",
                "MOEGRAPH_ROPE_LAYOUT", "MOEGRAPH_ATTN_GQA", "MOEGRAPH_ROUTER_TOPK",
                "MOEGRAPH_NORM_SKIP", "MOEGRAPH_NORM_FORK", "MOEGRAPH_QKV_ONE_BACKWARD",
                "MOEGRAPH_NORM_REDUCE_TILE",
                "MOEGRAPH_WGRAD_TMA_STORE", "MOEGRAPH_WGRAD_PERSISTENT",
                "MOEGRAPH_WGRAD_WS", "MOEGRAPH_SLOT_GEMM_WS", "MOEGRAPH_FC1_WS",
                "MOEGRAPH_DACT_PAIRED", "MOEGRAPH_RESIDUAL_GEMM",
                "MOEGRAPH_COMBINE_RESIDUAL", "PYTORCH_CUDA_ALLOC_CONF")
