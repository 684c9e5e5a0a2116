"""Memory model of one training step: `step_model` builds it for a profile's run, one process
or one rank of a distributed run, from the formulas or from a GPU calibration, and
`StepModel.predict` predicts its peak for a choice of captured scopes and pool grouping. It
reads configs (and, when given, a calibration); it never allocates anything.

The model, lowest module first:
- scope_memory.py: per scope (attn, moe, mlp) saved activations, outputs and transients,
  the loss tail and the expert slot counts, with the notation.
- simulation.py: the step (static bytes, graph pools, I/O buffers, eager live bytes,
  allocator slack) simulated for a capture choice.
- parallel.py: one rank of a distributed run.
- this file: the model of a run, put together; in one process parameter gradients are
  written in place (`written_grads`); a calibration replaces the formulas.
runkey.py says what a plan, a calibration or a savings file is valid for.

Distributed runs (`parallel`, W ranks, P-way expert parallel): the same model predicts ONE
rank; plan/parallel.py supplies its static memory (FSDP2-sharded dense parameters, E/P
experts), its moe scope and the FSDP2 working set of the eager part. W = P = 1 is this file's
single-process model, unchanged.

Calibration (plan/calibration.py): measured per-scope sizes and per-entry pools replace the
formulas; the same simulation run over the calibration's one-layer model, against that model's
measured pools and eager peak reserved, gives offsets (allocator rounding, fragmentation,
library workspaces) that are added to every prediction for the full model.
"""

from __future__ import annotations

import dataclasses

from ..config import Profile
from ..report.summary import DTYPE_BYTES, rope_buffer_bytes, static_memory
from .parallel import Parallel, fsdp_layout, moe_memory_ep, static_per_rank
from .scope_memory import ScopeMemory, attn_memory, mlp_memory, moe_memory, tail_memory
from .simulation import (FRAGMENTATION, RUNTIME_BYTES, RUNTIME_GRAPH_BYTES, STRATEGIES,
                         StepModel, scope_refs)


def step_model(prof: Profile, device_type: str = "cuda", calibration: dict | None = None,
               fragmentation: float = FRAGMENTATION, parallel=None) -> StepModel:
    """The analytical model of `prof`'s step; a calibration entry (calibration.py) for the
    same run replaces the per-scope numbers and adds the measured allocator offsets.
    `parallel` (parallel.Parallel(world, ep)): the model of one rank of that distributed run;
    None or (1, 1) is one process."""
    b = DTYPE_BYTES[prof.run.dtype]
    T, H = prof.run.batch * prof.run.seq_len, prof.model.hidden_size
    if parallel is not None and parallel.single:
        parallel = None
    if parallel is not None and calibration is not None:
        raise ValueError("a calibration is measured in one process; it cannot model a rank "
                         f"of --nproc {parallel.world} --ep {parallel.ep}")
    moe = moe_memory(prof, device_type) if parallel is None or parallel.ep == 1 else \
        moe_memory_ep(prof, parallel, device_type)
    kinds = {"attn": attn_memory(prof, device_type), "moe": moe,
             "mlp": mlp_memory(prof, device_type)}
    if parallel is None:
        kinds = written_grads(kinds, prof, device_type)
    if parallel is None:
        static = dict(static_memory(prof.model, prof.run.dtype))
    else:
        static = static_per_rank(prof, parallel)[0]
    breakdown = static_per_rank(prof, parallel or Parallel())[1]
    static["buffers"] = rope_buffer_bytes(prof.model, prof.run.seq_len, prof.run.dtype)
    static["total"] += static["buffers"]
    breakdown.update(buffer_bytes=static["buffers"], total_bytes=static["total"])
    model = StepModel(prof=prof, scopes=scope_refs(prof), kinds=kinds, static=static,
                      stream=b * T * H, tail=tail_memory(prof, sinks=parallel is None, device_type=device_type),
                      fragmentation=fragmentation,
                      runtime=RUNTIME_BYTES if device_type == "cuda" else 0,
                      runtime_graph=RUNTIME_GRAPH_BYTES if device_type == "cuda" else 0,
                      parallel=parallel, static_breakdown=breakdown,
                      fsdp=fsdp_layout(prof, parallel) if parallel is not None else None)
    if calibration is not None:
        apply_calibration(model, calibration)
    return model


def written_grads(kinds: dict[str, ScopeMemory], prof: Profile, device_type: str
                  ) -> dict[str, ScopeMemory]:
    """One process: every parameter is a gradient sink (grads.py), so a scope's backward
    writes its weight gradients straight into the persistent `.grad` buffers (static memory)
    and they leave its transient. The reference experts (the CPU path) still materialise
    theirs before depositing them."""
    backend = prof.moe.backend
    if backend == "auto":
        backend = "permute_free" if device_type == "cuda" else "reference"
    out = {}
    for name, m in kinds.items():
        if name == "moe" and backend == "reference":
            out[name] = m
        else:
            out[name] = dataclasses.replace(m, bwd_transient=m.bwd_transient - m.param_grads)
    return out


def apply_calibration(model: StepModel, entry: dict) -> None:
    """Measured per-scope numbers replace the formulas; offsets absorb what the formulas miss
    (allocator rounding and fragmentation, library workspaces), measured on one layer. The
    `fc1` and `keep` modes' numbers (the bytes of Y1 and of FC1's activation, exact in the
    formulas) carry over, `fc1_saved` at most the measured `saved`: a calibration measures the
    default mode, and without them a calibrated plan would lose those rungs of its ladder."""
    for kind, s in entry.get("scopes", {}).items():
        if kind not in model.kinds:
            continue
        old = model.kinds[kind]
        saved, out = int(s["saved_bytes"]), int(s["out_bytes"])
        pools = s.get("private_pools")
        model.kinds[kind] = ScopeMemory(
            kind=kind, saved=saved, out=out, in_grad=int(s.get("in_grad_bytes", old.in_grad)),
            fwd_transient=max(0, int(s["fwd_peak_bytes"]) - saved - out),
            bwd_transient=max(0, int(s["bwd_peak_bytes"])),
            param_grads=old.param_grads, saves_input=bool(s.get("saves_input", False)),
            source="calibration",
            private_pools=(int(pools[0]), int(pools[1])) if pools else None,
            fc1_saved=min(old.fc1_saved, saved), fc1_transient=old.fc1_transient,
            keep_saved=old.keep_saved, keep_fwd_less=old.keep_fwd_less,
            keep_bwd_less=old.keep_bwd_less)
    layer = entry.get("layer_model")
    if layer:
        # The same simulation over the calibration's one-layer model, against its measurement.
        probe = _one_layer_probe(model)
        everything = (True,) * len(probe.scopes)
        for strategy, measured in layer.get("pools", {}).items():
            predicted = probe.predict(everything, strategy).pool_bytes if strategy in \
                STRATEGIES and strategy != "per_entry" else None
            if predicted is not None:
                n_pools = max(1, len(probe.predict(everything, strategy).pools))
                model.pool_offsets[strategy] = int((int(measured) - predicted) / n_pools)
        if layer.get("eager_peak_reserved"):
            base = probe.predict((False,) * len(probe.scopes), "shared").eager_phase_peak
            model.eager_offset = int(layer["eager_peak_reserved"]) - base
    model.source = "calibration"


def one_layer_profile(prof: Profile) -> Profile:
    """The profile cut to one MoE layer: what a calibration builds and measures."""
    cfg = dataclasses.replace(prof.model, num_hidden_layers=1, mlp_only_layers=[],
                              decoder_sparse_step=1)
    return dataclasses.replace(prof, model=cfg, run=dataclasses.replace(prof.run),
                               moe=dataclasses.replace(prof.moe))


def _one_layer_probe(model: StepModel) -> StepModel:
    prof = one_layer_profile(model.prof)
    static = dict(static_memory(prof.model, prof.run.dtype))
    static["total"] += model.static.get("buffers", 0)
    probe = dataclasses.replace(model, prof=prof, scopes=scope_refs(prof), static=static,
                                pool_offsets={}, eager_offset=0)
    return probe
