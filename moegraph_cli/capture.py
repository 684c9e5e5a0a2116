"""`moegraph capture`: eager steps, transactional capture, replayed steps, side by side."""

from __future__ import annotations

import time

import torch

from .capability import check_capturable
from .errors import UsageError
from .flops import peak_flops, step_flops
from .harness import (GraphTrainer, build_session, capture_into, device_info, peaks,
                      reset_peaks, set_memory_limit, timed_steps)
from .render import Progress
from .runspec import RunSpec, build_model, pick_device
from .train import batches
from .units import parse_bytes


def capture_command(spec: RunSpec, steps: int | None = None, warmup: int | None = None,
                    plan_file: str | None = None, memory_limit: str | None = None,
                    progress: bool = True) -> dict:
    prof, run = spec.profile, spec.profile.run
    device = pick_device(run.device, need_cuda=True)
    plan = None
    if plan_file:
        from .plan.planfile import load_plan
        plan = load_plan(plan_file, prof)
    check_capturable(prof, None if plan else run.pool)
    steps = run.steps if steps is None else steps
    warmup = run.warmup if warmup is None else warmup
    if steps <= 0 or warmup < 0:
        raise UsageError("--steps must be positive and --warmup non-negative")
    limit = set_memory_limit(parse_bytes(memory_limit, "--memory-limit")
                             if memory_limit else None, device)

    torch.manual_seed(run.seed)
    model = build_model(spec, device)
    trainer = GraphTrainer(model, run.lr, run.weight_decay)
    it = batches(prof.model.vocab_size, run.batch, run.seq_len, run.seed, device, run.data)
    tokens = run.batch * run.seq_len
    flops, peak = step_flops(prof.model, run.batch, run.seq_len), peak_flops(device)

    total = 2 * (warmup + steps) + 1
    with Progress(progress, total, "eager steps") as bar:
        reset_peaks()
        eager = timed_steps(trainer, it, steps, warmup, on_step=bar.advance)
        eager.update(peaks())
        del eager["all_ms"]
        torch.cuda.empty_cache()
        reset_peaks()

        bar.describe("capturing")
        session = build_session(model, run.scopes, run.pool, plan)
        t0 = time.perf_counter()
        ok = capture_into(model, session, next(it))
        capture_s = time.perf_counter() - t0
        # What capture needed at its peak (warm-up included) is reported on its own; the
        # graph-phase peak below is the steady state, with capture's leftovers released.
        capture_peak = peaks()["peak_reserved"]
        torch.cuda.empty_cache()
        reset_peaks()
        trainer.session = session if ok else None
        bar.advance("graph steps" if ok else "eager steps (capture rolled back)")
        failure = session.failure
        try:
            graph = timed_steps(trainer, it, steps, warmup, on_step=bar.advance)
        except torch.OutOfMemoryError as e:
            # Graph pools left too little for the eager parts: roll back and go on eagerly.
            session.rollback(f"OutOfMemoryError during graph steps: {str(e).splitlines()[0]}")
            failure, trainer.session = session.failure, None
            torch.cuda.empty_cache()
            graph = timed_steps(trainer, it, steps, 0, on_step=bar.advance)
        graph.update(peaks())
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
        "step_flops": flops, **device_info(),
    }
    if plan is not None:
        result["plan"] = {"file": plan_file, "predicted_peak": plan.predicted_peak,
                          "measured_peak_reserved": graph["peak_reserved"]}
    session.uninstall()
    return result
