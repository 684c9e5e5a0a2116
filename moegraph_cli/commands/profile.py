"""`moegraph profile`: where graphs save time, and what they cost in memory.

One run on the GPU:
1. eager steps (timed; one more under torch.profiler counts kernel launches per step),
2. capture (harness.build_session / capture_into, the run's scopes and pool),
3. graph steps (timed; one profiled),
4. per scope: its eager forward+backward (the module's own forward on a copy of its static
   input, the static grad-output as gradient) and its two graphs replayed, each timed with
   CUDA events after a device sync so the host's launch cost shows; saved = eager - replay.
An NVML sampler records device memory used and utilisation throughout (nvml.py).
Outputs: the savings file `moegraph plan --savings` reads (--out, JSON), a calibration entry
for `moegraph plan --calibration` (--calibrate FILE: see `calibrate`), and a PNG (--plot).

Distributed (`rt`): every rank runs the same sequence (the per-scope replays too, since moe
graphs hold collectives); rank 0 writes the files and returns one document with every rank's
figures. A calibration is measured in one process (--calibrate is refused with --nproc).
"""

from __future__ import annotations

import gc
import json
import statistics
import weakref
from pathlib import Path

import torch

from ..errors import NotCapturableError, UsageError
from ..report.flops import peak_flops, step_flops
from ..graphs.contract import module_state
from ..graphs.scope import _as_tuple
from ..train.harness import (attn_moe_phase, build_session, capture_into, device_info, make_trainer,
                             peaks, reset_peaks, timed_steps)
from ..report.nvml import NvmlSampler
from ..plan.runkey import run_key
from ..distributed.context import place, ticker
from ..distributed.overflow import overflow_report
from .preflight import check_inputs
from ..report.render import Progress
from ..train.runspec import RunSpec, build_model, pick_device
from ..train.trainer import Trainer, batches

# Host-side calls that start work on the GPU: one per eager kernel, one per graph replay.
LAUNCH_APIS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
               "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cudaMemcpyAsync",
               "cudaMemsetAsync"}
SCOPE_REPS = 10


def profile_command(spec: RunSpec, steps: int = 5, plot: str | None = None,
                    out: str | None = None, calibrate: str | None = None,
                    progress: bool = True, rt=None) -> dict | None:
    prof, run = spec.profile, spec.profile.run
    if calibrate and rt is not None:
        raise UsageError("--calibrate measures one process; run it without --nproc")
    rank, world, ep = place(rt)
    check_inputs(spec, steps=steps, world=world, ep=ep)
    if rank != 0:
        plot = out = None
    if plot:
        from ..report.plot import require_matplotlib
        require_matplotlib()
    device = pick_device(run.device if rt is None else str(rt.device), need_cuda=True)
    warmup = max(1, run.warmup)

    torch.manual_seed(run.seed)
    model = build_model(spec, device, rt=rt)
    trainer = make_trainer(model, run.lr, run.weight_decay, rt, run.grad_accum)
    it = batches(prof.model.vocab_size, run.batch * run.grad_accum, run.seq_len, run.seed, device, run.data,
                 rank=rank, world=world)
    flops, peak = step_flops(prof.model, run.batch * run.grad_accum, run.seq_len), peak_flops(device)

    with NvmlSampler(device.index if device.index is not None else torch.cuda.current_device()
                     ) as nv, Progress(progress and rank == 0, 2 * (steps + warmup) + 4,
                                       "eager steps") as bar:
        tick = ticker(bar, rt)
        nv.mark("eager")
        reset_peaks()
        eager = timed_steps(trainer, it, steps, warmup, on_step=tick)
        eager.update(peaks())
        eager_counts = count_launches(lambda: trainer.step(next(it)))
        tick("capturing")
        torch.cuda.empty_cache()

        nv.mark("capture")
        session = build_session(model, run.scopes, run.pool, rt=rt, grad_accum=run.grad_accum,
                                trainer=trainer)
        if not capture_into(model, session, next(it), rt, run.grad_accum):
            failure = session.failure
            session.uninstall()
            raise NotCapturableError(f"capture failed and was rolled back: {failure}")
        trainer.session = session
        torch.cuda.empty_cache()
        reset_peaks()
        tick("graph steps")

        nv.mark("graph")
        graph = timed_steps(trainer, it, steps, warmup, on_step=tick)
        graph.update(peaks())
        graph_counts = count_launches(lambda: trainer.step(next(it)))
        pools = session.pools()
        tick("per-scope timing")

        nv.mark("per-scope")
        scopes = time_scopes(session, SCOPE_REPS)
        tick()
        stats = session.stats()
        compare = None
        if run.scopes == ["step"]:
            session.uninstall()
            nv.mark("attn,moe")
            compare = attn_moe_phase(model, trainer, it, steps, warmup, run.grad_accum,
                                     graph["step_ms"])
        nv.mark("end")
    overflow = overflow_report(trainer)
    session.uninstall()
    trainer.session = None
    model = trainer = session = None  # free the model before calibrating
    gc.collect()
    torch.cuda.empty_cache()

    for phase in (eager, graph):
        del phase["all_ms"]
        phase["mfu"] = flops / (phase["step_ms"] / 1e3) / peak if peak else None
    key = run_key(prof, world, ep)
    result = {
        "profile": prof.name, "source": spec.source, "key": key, "scopes_requested": run.scopes,
        "pool": run.pool, "steps": steps, "scopes": scopes,
        "eager_step_ms": eager["step_ms"], "graph_step_ms": graph["step_ms"],
        "mfu_eager": eager["mfu"], "mfu_graph": graph["mfu"],
        "kernels_eager": eager_counts["launches"], "kernels_graph": graph_counts["launches"],
        "gpu_kernels_eager": eager_counts["gpu_kernels"],
        "gpu_kernels_graph": graph_counts["gpu_kernels"],
        "eager_peak_reserved": eager["peak_reserved"],
        "graph_peak_reserved": graph["peak_reserved"],
        "eager_peak_allocated": eager["peak_allocated"],
        "graph_peak_allocated": graph["peak_allocated"],
        "pools": pools, "pool_total_bytes": sum(p["bytes"] for p in pools),
        "counters": stats["totals"], "nvml": nv.summary(), "step_flops": flops,
        "out": out, "plot": plot, "calibration": calibrate, "compare": compare,
        **overflow, **device_info(),
    }
    if rt is not None:
        from ..distributed.context import merge_ranks
        docs = rt.gather_all(json.loads(json.dumps(result, default=str)))
        if rank != 0:
            return None
        result = merge_ranks(docs, rt)
        result["ranks"] = [{**row, **{k: d[k] for k in ("eager_step_ms", "graph_step_ms",
                                                         "eager_peak_reserved",
                                                         "graph_peak_reserved")}}
                           for row, d in zip(result["ranks"], docs)]
    if out:
        write_savings(out, result)
    if calibrate:
        from ..plan.calibration import write_entry
        write_entry(calibrate, calibrate_run(spec, device))
    if plot:
        from ..report.plot import profile_plot
        profile_plot(plot, result, nv.timeline())
    return json.loads(json.dumps(result, default=str))


def count_launches(fn) -> dict:
    """Host launch calls (kernels, copies, graph launches) and GPU kernels of one call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            fn()
            torch.cuda.synchronize()
        events = p.events()
    except Exception as e:  # noqa: BLE001 - CUPTI missing: report no counts, not a crash
        return {"launches": None, "gpu_kernels": None, "note": f"{type(e).__name__}: {e}"}
    launches = sum(1 for e in events if e.name in LAUNCH_APIS)
    kernels = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    return {"launches": launches, "gpu_kernels": kernels}


def _median_ms(fn, reps: int) -> float:
    """Median of `reps` timings; a sync before each start so host launch cost is counted."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_scopes(session, reps: int = SCOPE_REPS) -> list[dict]:
    """Per captured scope: eager forward+backward vs its forward and backward graph replays.

    Replaying a scope's two graphs alone is safe: its forward graph writes everything its
    backward graph reads, and both read only persistent static buffers besides."""
    rows = []
    for scope in session.scopes:
        if scope.fwd_graph is None or scope.bwd_graph is None:
            continue
        ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in scope.static_inputs]
        grads = [None if g is None else g.detach().clone() for g in scope.static_grad_outputs]

        def eager(scope=scope, ins=ins, grads=grads):
            # Sharded (moving) parameters: the graphs' static copies stand in for them.
            with scope.swapped():
                outs = _as_tuple(scope.eager(*ins))
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

        def replay(scope=scope):
            scope.fwd_graph.replay()
            scope.bwd_graph.replay()

        eager_ms, replay_ms = _median_ms(eager, reps), _median_ms(replay, reps)
        rows.append({"name": scope.name, "layer": scope.layer, "kind": scope.kind,
                     "eager_ms": eager_ms, "replay_ms": replay_ms,
                     "saved_ms": eager_ms - replay_ms,
                     "kernels": count_launches(eager)["launches"], "kernels_graph": 2})
        for t in ins:
            t.grad = None
        del ins, grads
    return rows


def write_savings(path: str, result: dict) -> None:
    """The per-scope savings file `moegraph plan --savings` reads (.json: JSON, else YAML)."""
    per_kind: dict[str, list[dict]] = {}
    for s in result["scopes"]:
        per_kind.setdefault(s["kind"], []).append(s)
    doc = {
        "moegraph_savings": 1, "key": result["key"], "gpu": result.get("gpu"),
        "torch": result.get("torch"), "date": result.get("date"), "pool": result["pool"],
        "reps": SCOPE_REPS,
        "scopes": {s["name"]: {k: s[k] for k in ("kind", "layer", "eager_ms", "replay_ms",
                                                 "saved_ms", "kernels")}
                   for s in result["scopes"]},
        "per_kind": {k: {f: statistics.mean(r[f] for r in rows)
                         for f in ("eager_ms", "replay_ms", "saved_ms")} | {"scopes": len(rows)}
                     for k, rows in per_kind.items()},
        "eager_step_ms": result["eager_step_ms"], "graph_step_ms": result["graph_step_ms"],
    }
    from ..io.outputs import write_text_atomically

    if Path(path).suffix == ".json":
        write_text_atomically(path, json.dumps(doc, indent=2) + "\n")
    else:
        import yaml
        write_text_atomically(path, yaml.safe_dump(json.loads(json.dumps(doc)), sort_keys=False))


# -- calibration ------------------------------------------------------------------------------
def calibrate_run(spec: RunSpec, device: torch.device) -> dict:
    """Measure a one-layer copy of the run's model (plan.memory.one_layer_profile): per scope
    its saved bytes, forward/backward peaks and private pools, then each pool strategy's pool
    bytes and one eager step's peak reserved. See plan/calibration.py for the file layout."""
    from ..models import MoeCausalLM
    from ..plan.memory import one_layer_profile
    from ..plan.simulation import STRATEGIES

    prof = spec.profile
    one = one_layer_profile(prof)
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(one.run.seed)
    model = MoeCausalLM.from_config(one.model, one.moe, one.run.seed, one.run.dtype, device)
    trainer = Trainer(model, one.run.lr, one.run.weight_decay)
    it = batches(one.model.vocab_size, one.run.batch, one.run.seq_len, one.run.seed, device)
    for _ in range(2):  # optimizer states, kernel compilation, library workspaces
        trainer.step(next(it))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reset_peaks()
    trainer.step(next(it))
    eager = peaks()

    ids = next(it)
    inputs: dict[str, list[torch.Tensor]] = {}

    def keep_input(name):
        def hook(_module, args):
            inputs.setdefault(name, [a.detach().clone() for a in args])  # returns None: args kept
        return hook

    hooks = [module.register_forward_pre_hook(keep_input(name))
             for name, _, _, module in model.scopes()]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    scopes = {}
    for name, _, kind, module in model.scopes():
        scopes[kind] = measure_scope(module, inputs.pop(name))
    gc.collect()
    torch.cuda.empty_cache()

    pools = {}
    for strategy in STRATEGIES:
        session = build_session(model, ["attn", "moe"], strategy)
        if not capture_into(model, session, ids):
            failure = session.failure
            session.uninstall()
            raise NotCapturableError(f"calibration capture ({strategy}) failed: {failure}")
        measured = session.pools()
        pools[strategy] = sum(p["bytes"] for p in measured)
        if strategy == "per_entry":
            by_name = {p["name"]: p["bytes"] for p in measured}
            for name, _, kind, _ in model.scopes():
                scopes[kind]["private_pools"] = [by_name.get(f"{name}.fwd", 0),
                                                 by_name.get(f"{name}.bwd", 0)]
        session.uninstall()
        del session
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    del model, trainer
    gc.collect()
    torch.cuda.empty_cache()
    return {"key": run_key(prof), **device_info(), "scopes": scopes,
            "layer_model": {"pools": pools, "eager_peak_reserved": eager["peak_reserved"],
                            "eager_peak_allocated": eager["peak_allocated"]}}


def measure_scope(module: torch.nn.Module, args: list[torch.Tensor]) -> dict:
    """One eager forward (saved tensors by storage, peak allocated) and one backward like a
    graphed scope's (autograd.grad of the input and every parameter, all held together)."""
    ins = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    params = [p for p in module.parameters() if p.requires_grad]
    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in module_state(module)}
    input_ptrs = {t.untyped_storage().data_ptr() for t in ins}
    packed: list[weakref.ref] = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in exclude:
            packed.append(weakref.ref(t))  # weakly: a node nothing reaches frees its tensors
        return t

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = _as_tuple(module(*ins))
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - before
    saved: dict[int, int] = {}  # storages still held once the forward is done
    for ref in packed:
        t = ref()
        if t is not None:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    saves_input = any(p in saved for p in input_ptrs)
    for p in input_ptrs:
        saved.pop(p, None)
    diff = [o for o in outs if o.requires_grad]
    grad_outs = [torch.randn_like(o).mul_(1e-3) for o in diff]
    wrt = [t for t in ins if t.requires_grad] + params
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(diff, wrt, grad_outs, allow_unused=True)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - before
    row = {"saved_bytes": int(sum(saved.values())),
           "out_bytes": int(sum(o.untyped_storage().nbytes() for o in outs)),
           "in_grad_bytes": int(grads[0].untyped_storage().nbytes()) if grads[0] is not None
           else 0,
           "saves_input": bool(saves_input), "fwd_peak_bytes": int(fwd_peak),
           "bwd_peak_bytes": int(bwd_peak)}
    del outs, diff, grad_outs, grads, ins
    return row


def steady_peaks(spec: RunSpec, plan_file: str | None = None, memory_limit: str | None = None,
                 steps: int = 3, warmup: int = 2) -> dict:
    """Eager steps, capture (the run's scopes and pool, or a plan), then graph steps whose
    peaks are measured after `empty_cache()`: the steady state a plan predicts. This is
    `moegraph capture` without its progress bar; the GPU tests and benchmarks/planner.py call
    it in a fresh process."""
    from .capture import capture_command

    return capture_command(spec, steps=steps, warmup=warmup, plan_file=plan_file,
                           memory_limit=memory_limit, progress=False)
