"""`moegraph capture`: eager steps, transactional capture, replayed steps, side by side.

Distributed (`rt`, one rank of a `--nproc` / torchrun job): every rank runs the same sequence
on its slice of the global batch; capture is installed only if every rank captured; rank 0
returns one document with every rank's figures (other ranks return None)."""

from __future__ import annotations

import time

import torch

from ..errors import MoegraphError
from ..report.flops import peak_flops, step_flops
from ..train.harness import (attn_moe_phase, build_session, capture_into, device_info,
                             dropped_routes, make_trainer, peaks, reset_peaks, set_memory_limit,
                             timed_steps)
from ..distributed.context import place, ticker
from ..distributed.overflow import overflow_report
from .preflight import check_inputs
from ..report.render import Progress
from ..train.allocator import eager_segments
from ..train.runspec import RunSpec, build_model, pick_device
from ..train.trainer import batches


def capture_command(spec: RunSpec, steps: int | None = None, warmup: int | None = None,
                    plan_file: str | None = None, memory_limit: str | None = None,
                    progress: bool = True, rt=None) -> dict | None:
    prof, run = spec.profile, spec.profile.run
    rank, world, ep = place(rt)
    inputs = check_inputs(spec, plan_file=plan_file, memory_limit=memory_limit, steps=steps,
                          warmup=warmup, world=world, ep=ep)
    device = pick_device(run.device if rt is None else str(rt.device), need_cuda=True)
    plan = inputs.plan
    steps = run.steps if steps is None else steps
    warmup = run.warmup if warmup is None else warmup
    limit = set_memory_limit(inputs.memory_limit, device)

    torch.manual_seed(run.seed)
    model = build_model(spec, device, rt=rt, plan=plan)
    trainer = make_trainer(model, run.lr, run.weight_decay, rt, run.grad_accum)
    it = batches(prof.model.vocab_size, run.batch * run.grad_accum, run.seq_len, run.seed, device, run.data,
                 rank=rank, world=world)
    tokens = run.batch * run.grad_accum * run.seq_len  # per rank and step
    flops, peak = step_flops(prof.model, run.batch * run.grad_accum, run.seq_len), peak_flops(device)

    total = 2 * (warmup + steps) + 1
    with Progress(progress and rank == 0, total, "eager steps") as bar:
        tick = ticker(bar, rt)
        reset_peaks()
        dropped_routes(model, reset=True)
        with eager_segments() as expandable:
            eager = timed_steps(trainer, it, steps, warmup, on_step=tick)
            eager.update(peaks())
        eager["expandable_segments"] = expandable
        eager["dropped_routes"] = dropped_routes(model, reset=True)
        eager.update(overflow_report(trainer))
        del eager["all_ms"]
        torch.cuda.empty_cache()
        reset_peaks()

        bar.describe("capturing")
        if rt is not None:
            rt.beat("capture")
        session = build_session(model, run.scopes, run.pool, plan, rt, run.grad_accum, trainer)
        t0 = time.perf_counter()
        ok = capture_into(model, session, next(it), rt, run.grad_accum)
        capture_s = time.perf_counter() - t0
        # What capture needed at its peak (warm-up included) is reported on its own; the
        # graph-phase peak below is the steady state, with capture's leftovers released.
        capture_peak = peaks()["peak_reserved"]
        torch.cuda.empty_cache()
        reset_peaks()
        trainer.session = session if ok else None
        tick("graph steps" if ok else "eager steps (capture rolled back)")
        failure = session.failure
        dropped_routes(model, reset=True)  # warm-up and recording ran the experts too
        try:
            graph = timed_steps(trainer, it, steps, warmup, on_step=tick)
        except torch.OutOfMemoryError as e:
            if rt is not None:
                # The other ranks are inside this step's collectives: no rank can go on alone.
                raise MoegraphError(f"out of memory during graph steps with the pools "
                                    f"captured: {str(e).splitlines()[0]}") from None
            # Graph pools left too little for the eager parts: roll back and go on eagerly.
            session.rollback(f"OutOfMemoryError during graph steps: {str(e).splitlines()[0]}")
            failure, trainer.session = session.failure, None
            torch.cuda.empty_cache()
            graph = timed_steps(trainer, it, steps, 0, on_step=tick)
        graph.update(peaks())
        graph["dropped_routes"] = dropped_routes(model)
        graph.update({k: v - eager[k] for k, v in overflow_report(trainer).items()})
        del graph["all_ms"]
        pools = session.pools() if session.captured else []
    stats = session.stats()

    for phase in (eager, graph):
        phase["tokens_per_s"] = tokens / (phase["step_ms"] / 1e3)
        phase["mfu"] = flops / (phase["step_ms"] / 1e3) / peak if peak else None
    if plan is not None:
        predicted = plan.predicted_pool_bytes()
        for p in pools:
            p["predicted_bytes"] = predicted.get(p["name"])
    reasons = sorted({f"{s['name']}: {s['fallback_reason']}" for s in stats["scopes"]
                      if s["fallback_reason"]})
    result = {
        "profile": prof.name, "source": spec.source, "scopes": run.scopes,
        "pool": "plan" if plan else run.pool, "batch": run.batch, "seq_len": run.seq_len,
        "dtype": run.dtype, "moe_mode": prof.moe.mode, "steps": steps, "warmup": warmup,
        "eager": eager, "graph": graph,
        "speedup": eager["step_ms"] / graph["step_ms"] if graph.get("step_ms") else None,
        "captured_ok": failure is None and session.captured,
        "capture_s": capture_s, "capture_peak_reserved": capture_peak,
        "counters": stats["totals"], "per_scope": stats["scopes"],
        "pools": pools, "pool_total_bytes": sum(p["bytes"] for p in pools),
        "failure": failure, "fallback_reasons": reasons, "memory_limit": limit,
        "step_flops": flops, "tokens_per_rank": tokens,
        "dropped_routes": eager["dropped_routes"] + graph["dropped_routes"],
        **overflow_report(trainer), **device_info(),
    }
    if plan is not None:
        result["plan"] = {"file": plan_file, "predicted_peak": plan.predicted_peak,
                          "measured_peak_reserved": graph["peak_reserved"]}
    session.uninstall()
    if run.scopes == ["step"] and rt is None:
        from ..plan.memory import step_model
        pred = step_model(prof).predict_step()
        for p in result["pools"]:
            p["predicted_bytes"] = pred.pool_bytes
        result["step_prediction"] = {"predicted_peak": pred.peak,
                                     "measured_peak_reserved": graph["peak_reserved"]}
        result["compare"] = attn_moe_phase(model, trainer, it, steps, warmup, run.grad_accum,
                                           graph["step_ms"])
        cmp = result["compare"]
        cmp["tokens_per_s"] = tokens / (cmp["step_ms"] / 1e3)
        cmp["mfu"] = flops / (cmp["step_ms"] / 1e3) / peak if peak else None
    if rt is None:
        return result
    from ..distributed.context import merge_ranks
    docs = rt.gather_all(result)
    if rt.rank != 0:
        return None
    merged = merge_ranks(docs, rt)
    merged["dropped_routes"] = sum(d["dropped_routes"] for d in docs)
    return merged

