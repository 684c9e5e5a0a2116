"""`moegraph plan`: per layer, which scopes to capture, and how graphs share pools, under a
memory budget, maximising the time saved. Nothing is captured here (plan/ never captures).

Search. Each layer chooses none, attn, moe or attn+moe; a pool strategy (shared, per_scope,
per_entry) applies to all. Scopes of one kind cost the same memory on every layer and the
predicted peak hardly depends on which layers are chosen, only on how many and on chaining
(consecutive captured scopes share their I/O buffers). So a candidate is a pair (a, m): attn
captured on layers [0, a) and the MoE/MLP scope on layers [0, m), contiguous, which maximises
chaining. Every pair (restricted by the requested scopes) and every allowed strategy is
simulated (simulation.StepModel.predict); the answer is the candidate saving the most time whose
predicted peak fits the budget, ties broken by the smaller peak, then by strategy order
(shared, per_scope, per_entry). The candidate set does not depend on the budget, so more
budget never saves less time, and a plan never predicts over its budget.

Savings per scope: measured by `moegraph profile` (eager minus replay ms, per scope name,
else the mean of its kind), or estimated as LAUNCHES[kind] * LAUNCH_US: a graph replay removes
the host cost of launching each kernel.

Distributed (`--nproc W --ep P`): the plan is for one rank of that run (plan never starts
processes): the memory model is plan/parallel.py's, the budget is one GPU's, and the plan's key
carries W and P, so `capture` refuses it for any other layout.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


from .capability import check_capturable, check_whole_step
from ..io.documents import at, check_format, is_number, read_document, show
from ..errors import MoegraphError, NotCapturableError, UsageError
from ..train.runspec import RunSpec
from ..units import fmt_bytes, parse_bytes
from . import loss_head
from .calibration import lookup
from .memory import step_model
from .parallel import Parallel
from .planfile import Plan, write_plan
from .costs import LAUNCH_US, LAUNCHES
from .recompute import cost_ms, ladder, modes_at
from .runkey import check_key, describe_key, run_key, same_run
from .scope_memory import loss_chunk_of
from .simulation import (FRAGMENTATION, KIND_OF_SCOPE, STRATEGIES, Prediction, ScopeRef,
                         StepModel)

AUTO_FRACTION = 0.9  # --budget auto: this share of the device's total memory


@dataclass
class Savings:
    per_name: dict[str, float]
    per_kind: dict[str, float]
    source: str

    def of(self, ref: ScopeRef) -> float:
        if ref.name in self.per_name:
            return self.per_name[ref.name]
        return self.per_kind.get(ref.kind, LAUNCHES.get(ref.kind, 0) * LAUNCH_US / 1e3)


def estimated_savings() -> Savings:
    return Savings({}, {k: n * LAUNCH_US / 1e3 for k, n in LAUNCHES.items()},
                   f"estimate ({LAUNCH_US:g} us per kernel launch removed)")


def load_savings(path: str | Path, key: dict) -> Savings:
    """The per-scope savings file `moegraph profile --out` writes (YAML or JSON)."""
    path = Path(path)
    where = f"savings {path}"
    hint = "write one with `moegraph profile --out FILE` on a GPU"
    raw = read_document(path, "savings", hint)
    check_format(raw, where, "moegraph_savings", 1, "a moegraph savings file", hint)
    if not isinstance(raw.get("scopes"), dict):
        raise UsageError(f"{at(where, raw, 'scopes')}: scopes must be a mapping of scope name "
                         f"to saved_ms, got {show(raw.get('scopes'))}")
    check_key(raw.get("key"), where)
    if not same_run(raw["key"], key):
        raise UsageError(f"savings {path} was measured for {describe_key(raw['key'])}"
                         f", not this run {describe_key(key)}; profile this run again")
    per_name = {}
    for name, s in raw["scopes"].items():
        if not isinstance(s, dict) or not is_number(s.get("saved_ms")):
            raise UsageError(f"{at(where, raw['scopes'], name)}: scope {show(name)} has no numeric "
                             "saved_ms")
        per_name[str(name)] = float(s["saved_ms"])
    per_kind_raw = raw.get("per_kind") or {}
    if not isinstance(per_kind_raw, dict):
        raise UsageError(f"{at(where, raw, 'per_kind')}: per_kind must be a mapping of scope "
                         f"kind to saved_ms, got {show(per_kind_raw)}")
    per_kind = {}
    for kind, v in per_kind_raw.items():
        if not isinstance(v, dict) or not is_number(v.get("saved_ms")):
            raise UsageError(f"{at(where, per_kind_raw, kind)}: per_kind {show(kind)} has no numeric "
                             "saved_ms")
        per_kind[str(kind)] = float(v["saved_ms"])
    return Savings(per_name, per_kind, f"measured ({path})")


def parse_budget(budget: str | int) -> tuple[int, str]:
    if isinstance(budget, int):
        return budget, "given"
    if str(budget).strip().lower() == "auto":
        import torch
        if not torch.cuda.is_available():
            raise UsageError("--budget auto reads the GPU's memory and there is no CUDA device "
                             "here; give a size, e.g. --budget 80GiB")
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return int(total * AUTO_FRACTION), \
            f"auto: {AUTO_FRACTION:.0%} of {torch.cuda.get_device_name()} ({fmt_bytes(total)})"
    return parse_bytes(budget, "--budget"), "given"


def arrangement(scopes: list[ScopeRef], n_attn: int, n_ffn: int) -> tuple[bool, ...]:
    """attn captured on layers [0, n_attn), the MoE/MLP scope on layers [0, n_ffn)."""
    return tuple(ref.layer < (n_attn if ref.kind == "attn" else n_ffn) for ref in scopes)


@dataclass
class Choice:
    prediction: Prediction
    saved_ms: float
    n_attn: int
    n_ffn: int
    modes: tuple[str, ...] = ()  # per scope: its recompute mode
    recompute_ms: float = 0.0  # the extra time the recompute costs (estimate)

    @property
    def net_ms(self) -> float:
        return self.saved_ms - self.recompute_ms


def _with_modes(model: StepModel, modes: tuple[str, ...]) -> StepModel:
    return dataclasses.replace(model, recompute=modes)


def fit(model: StepModel, captured, strategy: str, budget: int, base: tuple[str, ...],
        steps: list) -> tuple[tuple[str, ...], Prediction] | None:
    """The fewest recompute steps of the ladder (recompute.py) under which this capture
    choice fits the budget, and its prediction; None when even the whole ladder does not.
    Memory falls along the ladder, so a binary search over its length finds the prefix."""
    def predict(n):
        modes = modes_at(base, steps, n)
        return modes, _with_modes(model, modes).predict(captured, strategy)

    first = predict(0)
    if first[1].required <= budget:
        return first
    if not steps:
        return None
    lo, hi = 0, len(steps)
    best = predict(hi)
    if best[1].required > budget:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = predict(mid)
        if got[1].required <= budget:
            hi, best = mid, got
        else:
            lo = mid
    return best


def choose(model: StepModel, budget: int, scopes: list[str], strategies: list[str],
           savings: Savings, recompute: str = "auto",
           fits: dict | None = None) -> Choice | None:
    """The best candidate under `budget` (None when even capturing nothing, with all the
    recompute `recompute` allows, does not fit): the most time saved by graphs net of what
    the recompute it needs costs. `fits`, where given, keeps each (capture, strategy)'s fit
    for later calls on the same model, budget and recompute request."""
    fits = {} if fits is None else fits
    base, steps = ladder(model, recompute)
    layers = model.prof.model.num_hidden_layers
    # every layer count up to 16 layers; beyond, every GRID-th (and all layers), so a 61-layer
    # model's search stays a few hundred candidates
    grid = max(1, -(-layers // 16))
    counts = sorted(set(range(0, layers + 1, grid)) | {layers})
    attn_opts = counts if "attn" in scopes else [0]
    ffn_opts = counts if "moe" in scopes else [0]
    gain = [savings.of(ref) for ref in model.scopes]
    cands = []
    for a in attn_opts:
        for m in ffn_opts:
            cap = arrangement(model.scopes, a, m)
            cands.append((sum(g for g, c in zip(gain, cap) if c), a, m, cap))
    cands.sort(key=lambda c: -c[0])
    best: Choice | None = None
    for saved, a, m, cap in cands:
        if best is not None and saved < best.net_ms - 1e-9:
            break  # recompute only subtracts: nothing further down can beat the best
        for strategy in (strategies if any(cap) else strategies[:1]):
            key = (id(model), budget, recompute, cap, strategy)
            if key not in fits:
                fits[key] = fit(model, cap, strategy, budget, base, steps)
            got = fits[key]
            if got is None:
                continue
            modes, p = got
            c = Choice(p, saved, a, m, modes, cost_ms(model, modes, cap))
            if best is None or c.net_ms > best.net_ms + 1e-9 or \
                    (c.net_ms > best.net_ms - 1e-9 and p.peak < best.prediction.peak):
                best = c
    return best


def _layer_ranges(layers: list[int]) -> str:
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(parts)


def left_out(model: StepModel, best: Choice, budget: int, scopes: list[str], strategy: str,
             savings: Savings) -> list[str]:
    """What was not captured and why, one line per scope kind."""
    out = []
    cap = best.prediction.captured
    for kind in ("attn", "moe", "mlp"):
        refs = [(i, r) for i, r in enumerate(model.scopes) if r.kind == kind and not cap[i]]
        if not refs:
            continue
        where = f"{kind} on layer{'s' if len(refs) > 1 else ''} " \
            f"{_layer_ranges([r.layer for _, r in refs])}"
        if KIND_OF_SCOPE[kind] not in scopes:
            out.append(f"{where}: not requested (scopes: {','.join(scopes) or 'none'})")
            continue
        i, first = refs[0]
        nxt = tuple(c or j == i for j, c in enumerate(cap))
        if savings.of(first) <= 0:
            out.append(f"{where}: saves nothing ({savings.of(first):.3f} ms measured)")
            continue
        peak = min(model.predict(nxt, s).required
                   for s in ([strategy] if strategy else STRATEGIES))
        if peak <= budget:  # fits alone, but not with the contiguous layers the search keeps
            out.append(f"{where}: not in the best contiguous choice (layers from 0 upward)")
            continue
        out.append(f"{where}: capturing {first.name} too needs {fmt_bytes(peak)} (predicted "
                   f"peak plus allocation headroom), over the budget {fmt_bytes(budget)}")
    return out


def check_ranks(nproc: int | None, ep: int, num_experts: int) -> Parallel:
    """--nproc / --ep of `plan` (the run it predicts one rank of); exit 2 when invalid."""
    from ..distributed.layout import check_parallelism

    world = 1 if nproc is None else nproc
    if world < 1:
        raise UsageError(f"--nproc must be at least 1, got {world}")
    if ep > 1 and world == 1:
        raise UsageError(f"--ep {ep} needs several ranks: add --nproc N with N a multiple of "
                         f"{ep} (plan predicts one rank of that run)")
    check_parallelism(world, ep, num_experts)
    return Parallel(world, ep)


def plan_command(spec: RunSpec, budget: str | int = "auto", pool: str = "auto",
                 out: str | None = None, savings: str | None = None,
                 calibration: str | None = None,
                 fragmentation: float = FRAGMENTATION, nproc: int | None = 1,
                 ep: int = 1) -> dict:
    """Plan one process, or (nproc > 1) one rank of `--nproc nproc --ep ep`: the budget, the
    static memory and every prediction are per rank."""
    prof = spec.profile
    if spec.checkpoint is not None:
        from ..io.checkpoint import plan_load
        plan_load(spec.checkpoint, prof.model)  # names, shapes, dtypes, sizes: headers only
    parallel = check_ranks(nproc, ep, prof.model.num_experts)
    if calibration is not None and not parallel.single:
        raise UsageError(f"--calibration is measured in one process and cannot model a rank of "
                         f"--nproc {parallel.world} --ep {parallel.ep}; plan without it "
                         "(analytical memory model)")
    if pool not in ("auto", *STRATEGIES):
        raise UsageError(f"--pool {pool!r} must be auto, shared, per_scope or per_entry")
    if pool == "auto":
        strategies = ["per_entry"] if prof.run.dynamic_shapes else list(STRATEGIES)
    else:
        strategies = [pool]
    check_capturable(prof, strategies[0])
    budget_bytes, budget_note = parse_budget(budget)
    if not parallel.single and budget_note != "given":
        budget_note += ", per rank"
    key = run_key(prof, parallel.world, parallel.ep)
    entry, memory_source = lookup(calibration, key)
    model = step_model(prof, "cuda", entry, fragmentation, parallel=parallel)
    gains = load_savings(savings, key) if savings else estimated_savings()
    scopes = list(prof.run.scopes)

    static = model.static["total"]
    none = (False,) * len(model.scopes)
    if scopes == ["step"]:
        return _plan_step(loss_head.with_head(model, loss_chunk_of(prof)), prof, spec, key,
                          budget_bytes, budget_note, memory_source, out, parallel)
    heads = [(loss_head.with_head(model, rows), rows, ms)
             for rows, ms in loss_head.options(model)]
    # the least a step can need: nothing captured, every recompute the request allows, the
    # smallest head
    floor_model = heads[-1][0]
    base, steps = ladder(floor_model, prof.run.recompute)
    floor_modes = modes_at(base, steps, len(steps))
    floor = _with_modes(floor_model, floor_modes).predict(none, strategies[0])
    rank = "" if parallel.single else \
        f" per rank of --nproc {parallel.world} --ep {parallel.ep}"
    if budget_bytes < static:  # a valid request that cannot be met: exit 1, not usage
        raise MoegraphError(f"budget {fmt_bytes(budget_bytes)} is below the static memory of "
                            f"{prof.name}{rank} (weights, grads, AdamW states and buffers: "
                            f"{fmt_bytes(static)}); the smallest budget that fits a step is "
                            f"{fmt_bytes(floor.required)}")
    # every candidate's peak includes the eager phase: below it nothing fits, skip the search
    best, loss_rows, loss_ms = None, 0, 0.0
    fits: dict = {}  # the candidates below ask the chosen head's fits again
    if budget_bytes >= floor.required:
        for head_model, rows, ms in heads:  # the head whose plan nets the most time
            c = choose(head_model, budget_bytes, scopes, strategies, gains, prof.run.recompute,
                       fits)
            if c is not None and (best is None or c.net_ms - ms > best.net_ms - loss_ms + 1e-9):
                best, loss_rows, loss_ms, model = c, rows, ms, head_model
    if best is None:
        raise MoegraphError(_nothing_fits(floor_model, prof.name + rank, budget_bytes, floor,
                                          floor_modes, prof.run.recompute))
    p = best.prediction
    chosen_model = _with_modes(model, best.modes)
    strategy = p.strategy if any(p.captured) else None
    groups_of = _groups(model, p.captured, strategy)
    layers = []
    for layer in range(prof.model.num_hidden_layers):
        refs = [(i, r) for i, r in enumerate(model.scopes) if r.layer == layer]
        chosen = [r for i, r in refs if p.captured[i]]
        layers.append({
            "layer": layer,
            "scopes": [KIND_OF_SCOPE[r.kind] for r in chosen],
            "pool": strategy if chosen else None,
            "groups": {r.name: groups_of[r.name] for r in chosen},
            "predicted_bytes": sum(p.scope_bytes.get(r.name, 0) for r in chosen),
            "recompute": {r.kind: best.modes[i] for i, r in refs
                          if best.modes and best.modes[i] != "none"},
        })
    candidates = []
    for s in strategies:
        c = choose(model, budget_bytes, scopes, [s], gains, prof.run.recompute, fits)
        candidates.append({"pool": s, "saved_ms": c.saved_ms if c else None,
                           "predicted_peak": c.prediction.peak if c else None})
    result = {
        "profile": prof.name, "source": spec.source, "key": key,
        "world": parallel.world, "ep": parallel.ep,
        "static_breakdown": model.static_breakdown,
        "memory_model": memory_source, "savings_source": gains.source,
        "budget": budget_bytes, "budget_note": budget_note, "pool_request": pool,
        "pool": strategy, "scopes_requested": scopes, "layers": layers,
        "static_bytes": static, "eager_peak": p.eager_peak, "pool_bytes": p.pool_bytes,
        "io_bytes": p.io_bytes, "pools": p.pools, "predicted_peak": p.peak,
        # per-layer bytes are each scope's share of the pools plus its I/O buffers (which sit
        # outside the pools); the pools also hold working space: transients at the pool's
        # peak, fragmentation and segment rounding. layers - io + working = pools.
        "layers_bytes": sum(layer["predicted_bytes"] for layer in layers),
        "pool_working_bytes": p.pool_bytes - sum(layer["predicted_bytes"] for layer in layers)
        + p.io_bytes,
        "headroom_bytes": p.headroom, "required_budget": p.required,
        "graph_phase_peak": p.graph_phase_peak, "eager_phase_peak": p.eager_phase_peak,
        "worst_moment": p.worst_moment, "fragmentation": model.fragmentation,
        "saved_ms": best.saved_ms, "candidates": candidates,
        "recompute_request": prof.run.recompute, "recompute_ms": best.recompute_ms,
        "recompute_why": _recompute_why(model, best, budget_bytes, strategies),
        "loss_chunk": loss_rows, "loss_chunk_ms": loss_ms,
        "loss_why": _loss_why(prof, loss_rows, loss_ms, heads),
        "left_out": left_out(chosen_model, best, budget_bytes, scopes,
                             strategy or strategies[0], gains),
        "scope_memory": {k: v.to_dict() for k, v in model.kinds.items()
                         if any(r.kind == k for r in model.scopes)},
        "out": out,
    }
    if out:
        extra = {k: result[k] for k in ("world", "ep", "static_bytes", "static_breakdown",
                                        "eager_peak", "pool_bytes", "io_bytes",
                                        "graph_phase_peak", "eager_phase_peak", "saved_ms",
                                        "memory_model", "savings_source", "fragmentation",
                                        "recompute_request", "recompute_ms", "recompute_why",
                                        "loss_chunk", "left_out")}
        write_plan(out, Plan(key=key, pool=strategy or "none", layers=layers, pools=p.pools,
                             predicted_peak=p.peak, budget=budget_bytes, extra=extra))
    return json.loads(json.dumps(result, default=str))


def _loss_why(prof, rows: int, ms: float, heads: list) -> str:
    """One line: how the plan runs the lm head and loss, and why."""
    if prof.run.loss_chunk != "auto":
        return ("the logits whole (run.loss_chunk=0)" if rows == 0 else
                f"in chunks of {rows} rows (run.loss_chunk={rows})")
    if rows == 0:
        return "the logits whole: chunks would not make the plan faster"
    whole = heads[0][0].tail
    chunked = next(m.tail for m, r, _ in heads if r == rows)
    return (f"in chunks of {rows} rows: the head keeps {fmt_bytes(chunked['logits'])} from its "
            f"forward to its backward instead of {fmt_bytes(whole['logits'])} of logits, which "
            f"buys graphs or recompute worth more than the about {ms:.2f} ms/step it costs "
            "(estimate)")


def _recompute_why(model: StepModel, best: Choice, budget: int, strategies: list[str]) -> str:
    """One line: which recompute the plan chose and why (and where the experts keep FC1's
    activation, the `keep` mode: less than no recompute)."""
    chosen, kept = {}, []
    for ref, mode in zip(model.scopes, best.modes):
        if mode == "keep":
            kept.append(ref.layer)
        elif mode != "none":
            chosen.setdefault(f"{ref.kind} {mode}", []).append(ref.layer)
    request = model.prof.run.recompute
    keep = (f"; the experts keep FC1's activation on layers {_layer_ranges(kept)}"
            if kept else "")
    if not chosen:
        return ("none needed: the choice fits the budget without recompute" if request ==
                "auto" else f"none (run.recompute={request})") + keep
    what = "; ".join(f"{name} on layers {_layer_ranges(layers)}"
                     for name, layers in chosen.items())
    if request != "auto":
        return f"{what} (run.recompute={request}, on every layer)"
    p = best.prediction
    without = model.predict(p.captured, p.strategy if any(p.captured) else strategies[0])
    return (f"{what}: without it this capture choice needs {fmt_bytes(without.required)}, over "
            f"the budget {fmt_bytes(budget)}; it costs about {best.recompute_ms:.2f} ms/step "
            f"(estimate){keep}")


def _nothing_fits(model: StepModel, who: str, budget: int, floor: Prediction,
                  floor_modes: tuple[str, ...], request: str) -> str:
    """Why not even the leanest step fits: the largest part of its peak named."""
    lean = _with_modes(model, floor_modes)
    saved = sum(lean.memory(i).saved for i in range(len(model.scopes)))
    parts = {"static memory (weights, grads, AdamW states)": floor.static_bytes,
             "saved activations": saved,
             "the rest of the eager peak (transients, loss, I/O)":
                 floor.eager_phase_peak - floor.static_bytes - saved}
    if model.parallel is not None and model.parallel.ep > 1:
        parts["expert-parallel buffers (in the moe scope)"] = \
            model.kinds["moe"].saved + model.kinds["moe"].fwd_transient
    top = max(parts, key=parts.get)
    how = {"auto": "even with nothing captured and every layer recomputed",
           "none": "even with nothing captured (run.recompute=none: no recompute)"}.get(
               request, f"even with nothing captured and run.recompute={request}")
    return (f"budget {fmt_bytes(budget)} does not fit one training step of {who} {how}; the "
            f"smallest budget that fits is {fmt_bytes(floor.required)}, most of it "
            f"{top} ({fmt_bytes(parts[top])})")


def _plan_step(model: StepModel, prof, spec, key, budget_bytes: int, budget_note: str,
               memory_source: str, out: str | None, parallel: Parallel) -> dict:
    """`--scopes step`: price the whole step as one graph; refuse (exit 4) where it cannot be
    captured whole or does not fit the budget, naming why."""
    check_whole_step(parallel.world)
    if out:
        raise UsageError("--out: a whole-step graph has no per-layer choices to write; run "
                         "capture --scopes step (no --plan)")
    p = model.predict_step()
    if p.required > budget_bytes:
        raise NotCapturableError(
            f"--scopes step: the whole step needs {fmt_bytes(p.required)} (static "
            f"{fmt_bytes(p.static_bytes)}, step pool {fmt_bytes(p.pool_bytes)}, headroom "
            f"{fmt_bytes(p.headroom)}) over the budget {fmt_bytes(budget_bytes)}; plan "
            "--scopes attn,moe, which picks the layers that fit")
    result = {
        "profile": prof.name, "source": spec.source, "key": key, "world": 1, "ep": 1,
        "static_breakdown": model.static_breakdown, "memory_model": memory_source,
        "savings_source": None, "budget": budget_bytes, "budget_note": budget_note,
        "pool_request": "step", "pool": "step", "scopes_requested": ["step"], "layers": [],
        "static_bytes": p.static_bytes, "eager_peak": p.eager_peak, "pool_bytes": p.pool_bytes,
        "io_bytes": 0, "pools": p.pools, "predicted_peak": p.peak, "layers_bytes": 0,
        "pool_working_bytes": p.pool_bytes, "headroom_bytes": p.headroom,
        "required_budget": p.required, "graph_phase_peak": p.graph_phase_peak,
        "eager_phase_peak": p.eager_phase_peak, "worst_moment": p.worst_moment,
        "fragmentation": model.fragmentation, "saved_ms": None, "candidates": [],
        "left_out": [], "scope_memory": {}, "out": None,
    }
    return json.loads(json.dumps(result, default=str))


def _groups(model: StepModel, captured, strategy: str | None) -> dict[str, str | None]:
    out = {}
    for ref, cap in zip(model.scopes, captured):
        if cap:
            out[ref.name] = {"shared": "shared", "per_scope": ref.kind}.get(strategy)
    return out
