"""Rendering: rich tables for people, JSON for machines (stdout), logs and errors on stderr.
Everything for stdout goes through report/stdout.py, whose failures are one line."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from ..errors import one_line
from .stdout import stdout
from .summary import fold_layers
from ..units import fmt_bytes

out = Console(file=stdout, highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def error(message: str) -> None:
    err.print(f"moegraph: error: {one_line(message)}", markup=False)


def warning(message: str) -> None:
    err.print(f"moegraph: warning: {message}", markup=False)


def log(message: str) -> None:
    err.print(message, markup=False)


def emit_json(obj) -> None:
    stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    stdout.flush()


def _table(title: str, columns: list[str]) -> Table:
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    return t


def _ms(x):
    return "-" if x is None else f"{x:.2f}"


def init_result(r: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(r)
    out.print(f"wrote {r['profile']} ({r['params']:,} params, {r['dtype']}, seed {r['seed']}) "
              f"to {r['dir']}: {len(r['files'])} files, {fmt_bytes(r['bytes'])}")


def inspect_result(s: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(s)
    a, p, m = s["architecture"], s["params"], s["static_memory_bytes"]
    t = _table(f"{s['name']} ({s['source']})", ["field", "value"])
    for k, v in a.items():
        t.add_row(k, str(v))
    for section in ("run", "moe"):  # the names --set takes
        for k, v in s.get(section, {}).items():
            t.add_row(f"{section}.{k}", "-" if v is None else str(v))
    out.print(t)
    t = _table("parameters", ["part", "count"])
    for k, v in p.items():
        t.add_row(k, f"{v:,}")
    out.print(t)
    t = _table("static memory (weights, grads, AdamW states; buffers: rope cos/sin for "
               "run.seq_len) - what `moegraph plan` counts as static", ["part", "bytes"])
    for k, v in m.items():
        t.add_row(k, fmt_bytes(v))
    out.print(t)
    t = _table("layers (identical neighbours folded)", ["layers", "kind", "params per layer"])
    t.add_column("shapes", justify="left", no_wrap=True)
    for g in s["layer_groups"]:
        # one shape a line, none wrapped: a shape never breaks inside its brackets
        shapes = "\n".join(f"{_short_name(k)}{v}" for k, v in g["shapes"].items())
        t.add_row(_layer_span(g["first"], g["last"]), g["kind"], f"{g['params']:,}", shapes)
    out.print(t)


def _recompute_cell(modes: dict | None) -> str:
    """A layer's recompute modes, e.g. "attn full, moe fc1"; "-" for none."""
    return ", ".join(f"{kind} {mode}" for kind, mode in (modes or {}).items()) or "-"


def _short_name(key: str) -> str:
    """`attn.q_proj.weight` -> q_proj, `moe.w_gate_up` -> w_gate_up."""
    return key.split(".")[-2] if key.endswith("weight") else key.split(".")[-1]


def _layer_span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}\u2013{last}"


def plan_result(r: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(r)
    budget = fmt_bytes(r["budget"]) + (f" ({r['budget_note']})" if r.get("budget_note") not in
                                       (None, "given") else "")
    ranks = f" (one rank of --nproc {r['world']} --ep {r['ep']})" \
        if r.get("world", 1) > 1 else ""
    t = _table(f"plan: {r['profile']}{ranks} under {budget}; pool {r['pool'] or 'none'}",
               ["layers", "scopes", "pool", "recompute", "predicted bytes"])
    groups = fold_layers(r["layers"], lambda l: (l["scopes"], l["pool"], l["predicted_bytes"],
                                                  _recompute_cell(l.get("recompute"))))
    for i, g in enumerate(groups):
        each = fmt_bytes(g["predicted_bytes"]) + (f" \u00d7 {g['count']}" if g["count"] > 1
                                                  and g["predicted_bytes"] else "")
        t.add_row(_layer_span(g["first"], g["last"]), "+".join(g["scopes"]) or "none",
                  g["pool"] or "-", _recompute_cell(g.get("recompute")), each,
                  end_section=i + 1 == len(groups))
    reconcile = "layers_bytes" in r and r["pool_bytes"] > 0
    if reconcile:
        t.add_row("sum of layers", "", "", "", fmt_bytes(r["layers_bytes"]))
        t.add_row("- I/O buffers", "", "", "", fmt_bytes(r["io_bytes"]))  # the label has the sign
        t.add_row("+ working space", "", "", "", fmt_bytes(r["pool_working_bytes"]))
        t.add_row("= graph pools", "", "", "", fmt_bytes(r["pool_bytes"]))
    out.print(t)
    if reconcile:
        out.print("I/O buffers: captured scopes' static inputs and grad-outputs, outside the "
                  "pools (counted in the eager peak); working space: transients at a pool's "
                  f"peak, {r.get('fragmentation', 0) * 100:.0f}% fragmentation and segment "
                  "rounding", markup=False)
    if r.get("pools"):
        t = _table("graph pools (predicted)", ["pool", "bytes"])
        for name, size in r["pools"].items():
            t.add_row(name, fmt_bytes(size))
        out.print(t)
    sb = r.get("static_breakdown") or {}
    if r.get("world", 1) > 1 and sb:
        out.print(f"static per rank: dense {fmt_bytes(sb['dense_bytes'])} (FSDP2 shard of "
                  f"{sb['dense_params']:,} params over {r['world']} ranks) + experts "
                  f"{fmt_bytes(sb['expert_bytes'])} ({sb['local_experts']} experts a layer"
                  f"{_replicas(sb)}) + buffers {fmt_bytes(sb['buffer_bytes'])}; weights, "
                  "grads and AdamW states", markup=False)
    out.print(f"static {fmt_bytes(r['static_bytes'])} + graph pools {fmt_bytes(r['pool_bytes'])} "
              f"+ eager peak {fmt_bytes(r['eager_peak'])} (at {r.get('worst_moment', '?')}) = "
              f"predicted peak {fmt_bytes(r['predicted_peak'])}; with "
              f"{fmt_bytes(r.get('headroom_bytes', 0))} allocation headroom it needs "
              f"{fmt_bytes(r.get('required_budget', r['predicted_peak']))} of budget "
              f"{fmt_bytes(r['budget'])}"
              + ("" if r.get("saved_ms") is None else f"; saves {r['saved_ms']:.2f} ms/step"),
              markup=False)
    out.print(f"memory: {r.get('memory_model', '?')}, fragmentation "
              f"{r.get('fragmentation', 0) * 100:.0f}%; savings: {r.get('savings_source') or '-'}",
              markup=False)
    if r.get("recompute_why"):
        out.print(f"recompute: {r['recompute_why']}", markup=False)
    if r.get("loss_why"):
        out.print(f"loss head: {r['loss_why']}", markup=False)
    for item in r.get("left_out", []):
        out.print(f"left out: {item}", markup=False)
    if r.get("out"):
        out.print(f"wrote {r['out']}")


def capture_result(r: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(r)
    e, g = r["eager"], r["graph"]
    cols = [("eager", e), ("step" if r["scopes"] == ["step"] else "graph", g)]
    if r.get("compare"):
        cols.insert(1, ("attn,moe", r["compare"]))
    t = _table(f"capture: {r['profile']}  scopes={','.join(r['scopes'])}  pool={r['pool']}",
               [""] + [name for name, _ in cols])

    def row(label, fmt):
        t.add_row(label, *[fmt(c) for _, c in cols])

    row("iteration ms (median)", lambda c: _ms(c.get("step_ms")))
    row("tokens/s", lambda c: "-" if c.get("tokens_per_s") is None
        else f"{c['tokens_per_s']:,.0f}")
    row("throughput change", lambda c: "" if c is e or not c.get("step_ms")
        else f"{(e['step_ms'] / c['step_ms'] - 1) * 100:+.1f}%")
    row("peak allocated", lambda c: fmt_bytes(c.get("peak_allocated")))
    row("peak reserved", lambda c: fmt_bytes(c.get("peak_reserved")))
    row("MFU", lambda c: f"{c['mfu'] * 100:.1f}%" if c.get("mfu") is not None else "-")
    if _ep_bounded(r):
        row("EP overflow steps (redone)", lambda c: str(c.get("ep_overflow_steps", "-")))
        row("EP rows over the bound", lambda c: str(c.get("ep_overflow_rows", "-")))
    out.print(t)
    c = r["counters"]
    out.print(f"captured {c['captured']}  replayed {c['replayed']}  fallback {c['fallback']}  "
              f"input copies {c['input_copies']}")
    if r.get("pools"):
        t = _table("graph pools (memory_snapshot by pool id)",
                   ["pool", "graphs", "measured", "predicted"])
        for p in r["pools"]:
            t.add_row(p["name"], str(p["graphs"]), fmt_bytes(p["bytes"]),
                      fmt_bytes(p.get("predicted_bytes")))
        out.print(t)
    if r.get("plan"):
        pl = r["plan"]
        measured = pl.get("measured_peak_reserved")
        err = f" ({(measured / pl['predicted_peak'] - 1) * 100:+.1f}%)" \
            if measured and pl.get("predicted_peak") else ""
        out.print(f"plan {pl['file']}: predicted peak {fmt_bytes(pl.get('predicted_peak'))}, "
                  f"measured peak reserved {fmt_bytes(measured)}{err}", markup=False)
    sp = r.get("step_prediction")
    if sp:
        measured = sp.get("measured_peak_reserved")
        err = f" ({(measured / sp['predicted_peak'] - 1) * 100:+.1f}%)" if measured else ""
        out.print(f"whole step: predicted peak {fmt_bytes(sp['predicted_peak'])}, measured "
                  f"peak reserved {fmt_bytes(measured)}{err}", markup=False)
    if r.get("failure"):
        out.print(f"capture failed and rolled back: {r['failure']}", markup=False)
    for reason in r.get("fallback_reasons", []):
        out.print(f"fallback: {reason}", markup=False)
    if r.get("moe_mode") == "capacity" or r.get("dropped_routes"):
        out.print(f"dropped routes (capacity, all ranks): {r.get('dropped_routes', 0)}")
    ranks_table(r)


def _ep_bounded(r: dict) -> bool:
    """Expert parallel (or an overflow was counted): the bounded dispatch's rows are shown."""
    return r.get("ep", 1) > 1 or bool(r.get("ep_overflow_steps"))


def _ep_overflow_line(r: dict) -> None:
    if _ep_bounded(r):
        out.print(f"EP dispatch overflow: {r.get('ep_overflow_steps', 0)} steps redone through "
                  f"the all-gather, {r.get('ep_overflow_rows', 0)} rows over the bound (all "
                  "ranks)", markup=False)


def ranks_table(r: dict) -> None:
    """Distributed runs: each rank's own figures (step time, memory, counters)."""
    if not r.get("ranks"):
        return
    t = _table(f"per rank: world {r['world_size']}, ep {r['ep']}",
               ["rank", "eager ms", "graph ms", "eager peak reserved", "graph peak reserved",
                "captured", "replayed", "fallback"])
    for row in r["ranks"]:
        e, g, c = row.get("eager") or {}, row.get("graph") or {}, row.get("counters") or {}
        t.add_row(str(row["rank"]), _ms(e.get("step_ms")), _ms(g.get("step_ms")),
                  fmt_bytes(e.get("peak_reserved")), fmt_bytes(g.get("peak_reserved")),
                  str(c.get("captured", "-")), str(c.get("replayed", "-")),
                  str(c.get("fallback", "-")))
    out.print(t)


def profile_result(r: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(r)
    t = _table(f"profile: {r['profile']}  pool={r.get('pool')}",
               ["scope", "eager ms", "replay ms", "saved ms", "launches eager"])
    for s in r["scopes"]:
        t.add_row(s["name"], _ms(s["eager_ms"]), _ms(s["replay_ms"]), _ms(s["saved_ms"]),
                  "-" if s.get("kernels") is None else str(s["kernels"]))
    out.print(t)

    def pct(x):
        return "-" if x is None else f"{x * 100:.1f}%"

    cmp = r.get("compare")
    if cmp:  # --scopes step beside attn+moe graphs
        t = _table("step", ["", "eager", "attn,moe", "whole step"])
        t.add_row("iteration ms (median)", _ms(r["eager_step_ms"]), _ms(cmp.get("step_ms")),
                  _ms(r["graph_step_ms"]))
        t.add_row("peak reserved", fmt_bytes(r.get("eager_peak_reserved")),
                  fmt_bytes(cmp.get("peak_reserved")), fmt_bytes(r.get("graph_peak_reserved")))
        out.print(t)
    t = _table("step", ["", "eager", "graph"])
    t.add_row("iteration ms (median)", _ms(r["eager_step_ms"]), _ms(r["graph_step_ms"]))
    t.add_row("MFU", pct(r.get("mfu_eager")), pct(r.get("mfu_graph")))
    t.add_row("launches / step", str(r.get("kernels_eager", "-")), str(r.get("kernels_graph", "-")))
    t.add_row("GPU kernels / step", str(r.get("gpu_kernels_eager", "-")),
              str(r.get("gpu_kernels_graph", "-")))
    t.add_row("peak reserved", fmt_bytes(r.get("eager_peak_reserved")),
              fmt_bytes(r.get("graph_peak_reserved")))
    out.print(t)
    _ep_overflow_line(r)
    if r.get("pools"):
        out.print("graph pools: " + ", ".join(f"{p['name']} {fmt_bytes(p['bytes'])}"
                                              for p in r["pools"]), markup=False)
    nv = r.get("nvml") or {}
    if nv.get("note"):
        out.print(f"nvml: {nv['note']}", markup=False)
    elif nv.get("samples"):
        out.print(f"nvml: {nv['samples']} samples, max used {fmt_bytes(nv.get('max_used_bytes'))}"
                  f", mean utilisation {nv.get('mean_util_pct', 0):.0f}%", markup=False)
    for k in ("out", "plot", "calibration"):
        if r.get(k):
            out.print(f"wrote {r[k]}")
    if r.get("ranks"):
        t = _table(f"per rank: world {r['world_size']}, ep {r['ep']}",
                   ["rank", "eager ms", "graph ms", "eager peak reserved", "graph peak reserved",
                    "fallback"])
        for row in r["ranks"]:
            t.add_row(str(row["rank"]), _ms(row.get("eager_step_ms")),
                      _ms(row.get("graph_step_ms")), fmt_bytes(row.get("eager_peak_reserved")),
                      fmt_bytes(row.get("graph_peak_reserved")),
                      str((row.get("counters") or {}).get("fallback", "-")))
        out.print(t)


def verify_result(r: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(r)
    t = _table(f"verify: {r['profile']}  lr={r['lr']}  scopes={','.join(r['scopes'])}",
               ["step", "eager loss", "graph loss", "equal"])
    for i, (a, b) in enumerate(zip(r["eager_losses"], r["graph_losses"])):
        t.add_row(str(i), f"{a:.9g}", f"{b:.9g}", "yes" if a == b else f"{abs(a - b):.3g}")
    out.print(t)
    worst = r.get("grad_worst")
    out.print(f"gradient max-abs difference: {r['grad_max_abs']:.3g}"
              + (f" (largest in {worst})" if worst and worst != "-" else
                 " (no gradient differs)" if r["grad_max_abs"] == 0 else ""), markup=False)
    ref = r.get("reference")
    if ref and ref.get("kind") == "single":
        t = _table(f"distributed ({r['world_size']} ranks) vs one process, same global batches",
                   ["step", "distributed loss", "single loss", "relative"])
        for i, (a, b) in enumerate(zip(ref["distributed_losses"], ref["single_losses"])):
            t.add_row(str(i), f"{a:.9g}", f"{b:.9g}", f"{abs(a - b) / max(abs(b), 1e-12):.3g}")
        out.print(t)
    elif ref:
        out.print(f"logits vs {ref['impl']} (fp32 copies of both): max-abs {ref['max_abs']:.3g} "
                  f"(tolerance {ref['tolerance']:g})")
        if ref.get("reference_set_from_config"):
            out.print(f"  this {ref['impl']} ignores {', '.join(ref['reference_set_from_config'])}"
                      " of the config (it hard-codes them); its model was given the config's"
                      " values", markup=False)
        if ref.get("first_near_tie") is not None:
            before = ref.get("max_abs_before_near_tie")
            out.print(f"  router near-tie (margin {ref['min_router_margin']:.3g}) first at "
                      f"position {ref['first_near_tie']}; max-abs before it "
                      + ("-" if before is None else f"{before:.3g}")
                      + f"; first position over tolerance: {ref.get('first_over_tolerance')}")
    c = r.get("counters", {})
    if c:
        out.print(f"graph side: captured {c['captured']}  replayed {c['replayed']}  "
                  f"fallback {c['fallback']}")
    _ep_overflow_line(r)
    if r.get("ranks"):
        t = _table("per rank", ["rank", "losses bitwise equal", "grad max-abs", "fallback",
                                "passed"])
        for row in r["ranks"]:
            t.add_row(str(row["rank"]), "yes" if row.get("bitwise_equal") else "no",
                      f"{row.get('grad_max_abs', 0):.3g}",
                      str((row.get("counters") or {}).get("fallback", "-")),
                      "yes" if row.get("passed") else "no")
        out.print(t)
    out.print(("PASS: " if r["passed"] else "FAIL: ") + r["verdict"], markup=False)


class Progress:
    """A rich progress bar on stderr (a no-op when disabled, e.g. under --json, and when stderr
    is not a terminal: a log file gets no bar remnants)."""

    def __init__(self, enabled: bool, total: int, description: str, in_bytes: bool = False):
        """`in_bytes`: total and advances are bytes (shown as sizes and a rate), else counts."""
        self.enabled, self.total = enabled and err.is_terminal, total
        self.description, self.done = description, 0  # kept when no bar is shown
        self._bar = None
        if self.enabled:
            from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, \
                Progress as RichProgress, TextColumn, TimeElapsedColumn, TransferSpeedColumn
            counts = (DownloadColumn(binary_units=True), TransferSpeedColumn()) if in_bytes \
                else (MofNCompleteColumn(),)
            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), *counts,
                                     TimeElapsedColumn(), console=err, transient=True)
            self._task = self._bar.add_task(description, total=total)

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def advance(self, description: str | None = None, amount: int = 1) -> None:
        self.description, self.done = description or self.description, self.done + amount
        if self._bar is not None:
            self._bar.update(self._task, advance=amount,
                             **({"description": description} if description else {}))

    def describe(self, description: str) -> None:
        self.description = description
        if self._bar is not None:
            self._bar.update(self._task, description=description)


def _replicas(sb: dict) -> str:
    """How the local experts are sharded over their R replicas: by rows of every expert, or
    by whole experts and, where some replicas then hold only padding, why the figure stops
    falling (plan/parallel.padding_replicas)."""
    replicas, idle = sb.get("expert_replicas", 1), sb.get("padding_replicas", 0)
    if replicas <= 1:
        return ""
    if sb.get("experts_sharded") is False:  # distributed/layout.experts_sharded
        return (f", whole on each of {replicas} replicas (this torch's FSDP2 has no "
                "per-parameter mesh; their gradients are all-reduced)")
    if sb.get("expert_shard_dim") == 1:  # distributed/layout.expert_shard_dim
        return f", each expert's rows sharded over {replicas} replicas"
    text = f", sharded over {replicas} replicas"
    if idle:
        text += f" by whole experts: {idle} of them hold only padding"
        if replicas > sb.get("local_experts", 0):
            text += (f", so this stays at one expert a layer past {sb['local_experts']} "
                     "replicas")
    return text
