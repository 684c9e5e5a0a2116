"""A graph session over a set of scopes: record, capture transactionally, install, report.

Lifecycle:
1. `record(run_forward)`: one eager forward with hooks keeps each scope's inputs and notes
   which scope's output feeds which scope's input (those pairs share buffers: chained).
2. `capture()`: eager warm-up of every scope on a side stream, then every forward graph in
   execution order and every backward graph in reverse, each into its pool group. All or
   nothing: on any failure (an OOM included) every graph is reset, the pools are freed, the
   failure is reported with the scope and layer, and the modules keep running eagerly.
3. `install()`: each module's forward becomes its graphed scope; `uninstall()` undoes it.
4. Per training step `new_step()` re-arms the pool groups; `stats()` has the counters and
   `pools()` the bytes each pool holds, read from the allocator's snapshot by pool id.
This module knows nothing of MoE or of any model: a scope is a module and its inputs.

Several processes (distributed training): graphs hold collectives, so whether a graph
replays must be the same on every rank, or one rank waits in a collective the others skip.
With `agree` given, `new_step()` runs every check that does not need the call's inputs
(`GraphedScope.precheck`) on this rank, and `agree` (an all-reduce across ranks, supplied by
the caller) turns the local reasons into the decisions of all ranks: a unit (a pooled group,
or an unpooled scope) that fails anywhere runs eagerly everywhere for that step. A contract
that breaks later, at the call, stops the run with an error instead of deciding alone.
`moving(name, param)` marks parameters that are graph inputs (see params.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from .backend import default_backend, release
from .params import ParamBuffers
from .pools import PoolGroup, capture_order, group_names, pool_bytes
from .scope import GraphedScope, _as_tuple


@dataclass
class ScopeSpec:
    name: str
    layer: int
    kind: str
    module: torch.nn.Module


class GraphSession:
    whole_step = False  # graphs/step.StepGraph is the whole-step counterpart
    def __init__(self, specs: list[ScopeSpec], strategy: str = "shared",
                 groups: dict[str, str | None] | None = None, warmup_iters: int = 3,
                 backend=None, moving=None, agree=None, accumulate: bool = False):
        self.backend = backend if backend is not None else default_backend()
        self.agree = agree
        self.accumulate = accumulate  # also capture accumulate-mode backward graphs
        self.buffers = ParamBuffers()
        gnames = group_names([s.name for s in specs], [s.kind for s in specs], strategy, groups)
        self.strategy = strategy if groups is None else "plan"
        self.warmup_iters = warmup_iters
        self.groups: dict[str, PoolGroup] = {}
        self.scopes: list[GraphedScope] = []
        for spec, gname in zip(specs, gnames):
            group = None
            if gname is not None:
                group = self.groups.setdefault(gname, PoolGroup(gname, pooled=True))
            scope = GraphedScope(spec.name, spec.layer, spec.kind, spec.module, group,
                                 self.backend, moving=moving, buffers=self.buffers)
            if group is not None:
                group.members.append(scope)
            scope.group.agreed = agree is not None
            self.scopes.append(scope)
        self.sample_inputs: list[list[torch.Tensor]] | None = None
        self.chain: list[list[tuple[int, int] | None]] = []
        self.installed = False
        self.captured = False
        self.failure: str | None = None

    # -- 1. record ----------------------------------------------------------------------
    def record(self, run_forward: Callable[[], object]) -> None:
        inputs: dict[int, list[torch.Tensor]] = {}
        raw_inputs: dict[int, tuple] = {}
        outputs: dict[int, tuple] = {}
        handles = []
        for i, s in enumerate(self.scopes):
            def pre(_mod, args, i=i):
                if i not in inputs:
                    raw_inputs[i] = args
                    inputs[i] = [a.detach().clone().requires_grad_(a.requires_grad)
                                 for a in args]

            def post(_mod, _args, out, i=i):
                outputs.setdefault(i, _as_tuple(out))

            handles.append(s.module.register_forward_pre_hook(pre))
            handles.append(s.module.register_forward_hook(post))
        try:
            with torch.enable_grad():
                run_forward()
        finally:
            for h in handles:
                h.remove()
        missing = [s.name for i, s in enumerate(self.scopes) if i not in inputs]
        if missing:
            raise RuntimeError(f"scope {missing[0]} was not called by the recorded forward")
        self.sample_inputs = [inputs[i] for i in range(len(self.scopes))]
        self.chain = []
        for i in range(len(self.scopes)):
            links = []
            for a in raw_inputs[i]:
                link = None
                for j in range(i - 1, -1, -1):
                    for o, out in enumerate(outputs[j]):
                        if out is a:
                            link = (j, o)
                            break
                    if link:
                        break
                links.append(link)
            self.chain.append(links)
        del raw_inputs, outputs

    # -- 2. capture ---------------------------------------------------------------------
    def capture(self) -> bool:
        if self.sample_inputs is None:
            raise RuntimeError("record() a forward before capture()")
        scope, phase = None, "warm-up"
        try:
            self.backend.synchronize()
            with self.backend.side_stream():
                for i, scope in enumerate(self.scopes):
                    scope.warm_up(self.sample_inputs[i], self.warmup_iters)
            self.backend.synchronize()
            for g in self.groups.values():
                g.make_handle(self.backend)
            for phase, i in capture_order(len(self.scopes)):
                scope = self.scopes[i]
                pool = scope.group.handle if scope.group.pooled else None
                if phase == "fwd":
                    scope.capture_forward(self._static_inputs(i), pool)
                else:
                    scope.capture_backward(pool, self._grad_output_buffers(i),
                                           accumulate_too=self.accumulate)
            self.backend.synchronize()
            self._drop_chained_samples()
        except Exception as e:  # noqa: BLE001 - any failure rolls the whole capture back
            where = f"{phase} of {scope.name} (layer {scope.layer})" if scope else phase
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            reason = f"{type(e).__name__} during {where}: {first}"[:400]
        else:
            reason = None
        if reason is not None:
            # Outside the handler: the exception's frames (warm-up outputs, half-recorded
            # static buffers) are gone before the release returns their memory.
            self.rollback(reason)
            return False
        self.captured = True
        self.failure = None
        return True

    def _drop_chained_samples(self) -> None:
        """A chained input reads its producer's static output; its recorded copy is dead."""
        for i, links in enumerate(self.chain):
            for a, link in enumerate(links):
                if link is not None:
                    self.sample_inputs[i][a] = None

    def _static_inputs(self, i: int) -> list[torch.Tensor]:
        out = []
        for a, (sample, link) in enumerate(zip(self.sample_inputs[i], self.chain[i])):
            if link is not None and self.scopes[link[0]].static_outputs:
                j, o = link
                out.append(self.scopes[j].static_outputs[o].detach()
                           .requires_grad_(sample.requires_grad))
            else:
                out.append(sample)
        return out

    def _grad_output_buffers(self, j: int) -> list:
        """For each output of scope j, the input-grad buffer of the scope it feeds, if any."""
        bufs = [None] * len(self.scopes[j].static_outputs)
        for k in range(j + 1, len(self.scopes)):
            for a, link in enumerate(self.chain[k]):
                if link is not None and link[0] == j and self.scopes[k].static_input_grads:
                    bufs[link[1]] = self.scopes[k].static_input_grads[a]
        return bufs

    def rollback(self, reason: str) -> None:
        self.uninstall()
        self.failure = reason
        release(self.backend)

    # -- 3. install ---------------------------------------------------------------------
    def install(self) -> None:
        if not self.captured:
            raise RuntimeError("nothing captured to install")
        for s in self.scopes:
            s.module.forward = s
        self.installed = True

    def uninstall(self) -> None:
        for s in self.scopes:
            if "forward" in s.module.__dict__:
                del s.module.forward
            s.reset()
        for g in self.groups.values():
            g.release()
        self.buffers.clear()
        self.sample_inputs, self.chain = None, []  # the recorded inputs: one [T, H] a scope
        self.installed = False
        self.captured = False

    @contextlib.contextmanager
    def suspended(self):
        """Inside, the modules run their own forwards (eager, not counted as fallbacks); the
        graphs, pools and static buffers stay as they are, nothing is re-captured, and the
        next step replays again. For a step redone eagerly: the caller agrees on it across
        ranks first (a graph holding collectives must be skipped on every rank or on none)."""
        if not self.installed:
            yield
            return
        for s in self.scopes:
            del s.module.forward
        try:
            yield
        finally:
            for s in self.scopes:
                s.module.forward = s

    # -- 4. per step and reports ----------------------------------------------------------
    def new_step(self) -> None:
        for s in self.scopes:
            s.pending = False
            s.forced_reason = None
            s.group.new_step()
        if self.agree is None or not self.installed:
            return
        local: dict[str, str | None] = {}
        for s in self.scopes:
            unit = s.group.name if s.group.pooled else s.name
            if local.get(unit) is None:
                reason = s.precheck()
                local[unit] = f"{s.name}: {reason}" if reason else None
        decided = self.agree(local)
        for s in self.scopes:
            reason = decided.get(s.group.name if s.group.pooled else s.name)
            if reason is None:
                continue
            if s.group.pooled:
                s.group.eager_this_step = reason
            else:
                s.forced_reason = reason

    def stats(self) -> dict:
        per = []
        tot = {"captured": 0, "replayed": 0, "backward_replayed": 0, "fallback": 0,
               "input_copies": 0, "grad_copies": 0, "param_copies": 0}
        for s in self.scopes:
            c = s.counters
            row = {"name": s.name, "layer": s.layer, "kind": s.kind,
                   "pool": s.group.name if s.group.pooled else "private",
                   "captured": c.captured, "replayed": c.replayed,
                   "backward_replayed": c.backward_replayed, "fallback": c.fallback,
                   "fallback_reason": c.fallback_reason, "input_copies": c.input_copies,
                   "grad_copies": c.grad_copies, "param_copies": c.param_copies}
            per.append(row)
            for k in tot:
                tot[k] += row[k]
        return {"totals": tot, "scopes": per, "failure": self.failure,
                "strategy": self.strategy}

    def pools(self) -> list[dict]:
        """Bytes per pool from the allocator: pooled groups by name, private pools per graph."""
        named: list[tuple[str, list]] = []
        for g in self.groups.values():
            named.append((g.name, [gr for s in g.members for gr in s.graphs()]))
        for s in self.scopes:
            if not s.group.pooled:
                for tag, gr in (("fwd", s.fwd_graph), ("bwd", s.bwd_graph),
                                ("bwd_acc", s.bwd_graph_acc)):
                    if gr is not None:
                        named.append((f"{s.name}.{tag}", [gr]))
        ids = {name: {self.backend.pool_id(gr) for gr in graphs} for name, graphs in named}
        if self.backend.name != "cuda":
            return [{"name": name, "graphs": len(graphs), "bytes": None, "allocated": None,
                     "pool_ids": []} for name, graphs in named if graphs]
        sizes = pool_bytes({pid for v in ids.values() for pid in v})
        out = []
        for name, graphs in named:
            if not graphs:
                continue
            reserved = sum(sizes[pid]["reserved"] for pid in ids[name])
            allocated = sum(sizes[pid]["allocated"] for pid in ids[name])
            out.append({"name": name, "graphs": len(graphs), "bytes": reserved,
                        "allocated": allocated, "pool_ids": sorted(ids[name])})
        return out
