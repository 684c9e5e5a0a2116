"""`moegraph verify`: eager against graph on the same batches, from the same weights.

With `--lr0` the learning rate is 0, so the weights never change and every step's loss must
be bitwise equal between the eager and the graphed model; gradients are compared element by
element (max-abs reported). With lr > 0 the loss curves must agree within a relative
tolerance. `--reference transformers` also compares the logits with transformers'
class of the model's family (Qwen3MoeForCausalLM, MixtralForCausalLM, ...) loaded from the
same weights.

On a CPU (`--set run.device=cpu`) the graphs are the emulated backend (graphs/backend.py):
the engine's logic, not CUDA graphs.

Distributed (`rt`): each rank compares its own losses and its own gradient shards; the
verdict is agreed by all ranks. `--reference single` then trains the same global batches in
one process (on rank 0, after the distributed models are freed) and compares its per-step
losses with the distributed ones (the mean of the ranks' losses), within `--tolerance`.
"""

from __future__ import annotations

import gc

import torch

from ..config.fields import check_option
from ..distributed.context import place, ticker
from ..distributed.overflow import overflow_report
from ..errors import MoegraphError, NotCapturableError, UsageError
from ..train.harness import build_session, capture_into, device_info, make_trainer
from .preflight import check_inputs
from ..report.render import Progress
from ..train.runspec import RunSpec, build_model, pick_device
from ..report.summary import static_memory
from ..train.trainer import Trainer, batches

REFERENCES = ("transformers", "single")


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor gradient's local shard (what this rank holds), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> tuple[float, str]:
    worst, where = 0.0, "-"
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        ga, gb = _local(pa.grad), _local(pb.grad)
        if ga is None or gb is None or ga.numel() == 0:
            continue
        d = (ga.float() - gb.float()).abs().max().item()
        if d != d:  # NaN
            return float("nan"), name
        if d > worst:
            worst, where = d, name
    return worst, where


def _refuse_non_finite(spec: RunSpec, model: torch.nn.Module, rt) -> None:
    """A NaN or an infinity among the weights makes both runs' losses NaN: that is no parity
    failure but bad weights, named before anything is compared (exit 1). A checkpoint's were
    checked as they loaded (runspec.build_model); this catches seeded ones (a huge
    initializer_range). Distributed: every rank scans its shards and all agree, naming the
    first rank's find."""
    from itertools import chain

    from ..models.common.finite import first_non_finite

    bad = first_non_finite(chain(model.named_parameters(), model.named_buffers()))
    reason = None
    if bad is not None:
        source = f"checkpoint {spec.checkpoint}" if spec.checkpoint else spec.source
        reason = (f"verify: weight {bad[0]} of {source} is not finite ({bad[1]}); eager "
                  "and graph losses on such weights compare nothing")
    if rt is not None:
        ok, reason = rt.all_ok(reason is None, reason)
        if ok:
            return
    if reason is not None:
        raise MoegraphError(reason)


def _free_memory(device: torch.device) -> float:
    if device.type != "cuda":
        return float("inf")
    return torch.cuda.mem_get_info(device)[0]


def verify_command(spec: RunSpec, lr0: bool = True, steps: int = 6, tolerance: float = 2e-2,
                   reference: str | None = None, progress: bool = True, rt=None) -> dict | None:
    prof, run = spec.profile, spec.profile.run
    check_option("--tolerance", tolerance)
    if reference is not None and reference not in REFERENCES:
        raise UsageError(f"--reference {reference!r} must be one of {', '.join(REFERENCES)}")
    if reference == "single" and rt is None:
        raise UsageError("--reference single compares a distributed run with one process; "
                         "add --nproc N")
    rank, world, ep = place(rt)
    check_inputs(spec, steps=steps, world=world, ep=ep)
    if rt is not None:
        device = rt.device
    else:
        try:
            device = pick_device(run.device, need_cuda=run.device != "cpu")
        except NotCapturableError as e:
            raise NotCapturableError(f"{e}; verify also runs on a CPU (emulated graphs) with "
                                     "--set run.device=cpu") from None
    lr = 0.0 if lr0 else run.lr
    side_by_side = 2.5 * static_memory(prof.model, run.dtype)["total"] / world \
        < _free_memory(device)

    def make():
        torch.manual_seed(run.seed)
        model = build_model(spec, device, rt=rt)
        return model, make_trainer(model, lr, run.weight_decay, rt, run.grad_accum)

    def batch_iter():
        return batches(prof.model.vocab_size, run.batch * run.grad_accum, run.seq_len, run.seed, device,
                       run.data, rank=rank, world=world)

    eager_losses, graph_losses, grad_max, grad_worst = [], [], 0.0, "-"
    with Progress(progress and rank == 0, 2 * steps + 1, "verify") as bar:
        tick = ticker(bar, rt)
        graph_model, graph_trainer = make()
        if rt is not None:
            rt.beat()  # each set-up stage that ends is progress for the watchdog
        _refuse_non_finite(spec, graph_model, rt)
        if rt is not None:
            rt.beat()
        gi = batch_iter()
        session = build_session(graph_model, run.scopes, run.pool, rt=rt,
                                grad_accum=run.grad_accum, trainer=graph_trainer)
        first = next(batch_iter())
        if rt is not None:
            rt.beat("capture")
        if not capture_into(graph_model, session, first, rt, run.grad_accum):
            failure = session.failure
            session.uninstall()
            raise NotCapturableError(f"capture failed: {failure}")
        graph_trainer.session = session
        backend_name = session.backend.name
        tick("steps")
        if side_by_side:
            eager_model, eager_trainer = make()
            ei = batch_iter()
            for _ in range(steps):
                eager_losses.append(float(eager_trainer.step(next(ei))))
                graph_losses.append(float(graph_trainer.step(next(gi))))
                d, w = _grad_diff(eager_model, graph_model)
                if d > grad_max or d != d:
                    grad_max, grad_worst = d, w
                tick()
                tick()
            stats = session.stats()
            overflow = overflow_report(graph_trainer)
        else:
            # Not enough memory for two models: graph run first, keep its last-step grads on
            # the host, then the eager run; losses are compared every step, grads at the last.
            for _ in range(steps):
                graph_losses.append(float(graph_trainer.step(next(gi))))
                tick()
            saved = {n: _local(p.grad).detach().to("cpu")
                     for n, p in graph_model.named_parameters()}
            stats = session.stats()
            overflow = overflow_report(graph_trainer)
            # Drop every reference to the graphs and their pools so the eager model gets
            # their memory back.
            session.uninstall()
            graph_trainer.session = session = None
            del graph_model, graph_trainer
            gc.collect()
            torch.cuda.empty_cache()
            eager_model, eager_trainer = make()
            ei = batch_iter()
            for _ in range(steps):
                eager_losses.append(float(eager_trainer.step(next(ei))))
                tick()
            for n, p in eager_model.named_parameters():
                g = _local(p.grad)
                if g.numel() == 0:
                    continue
                d = (g.detach().float().cpu() - saved[n].float()).abs().max().item()
                if d > grad_max or d != d:
                    grad_max, grad_worst = d, n
    ref = None
    if reference == "transformers":
        from .reference_check import logits_parity
        ref = logits_parity(eager_model, first, reference)
    if session is not None:  # the sequential path tore it down already
        session.uninstall()

    bitwise = all(a == b for a, b in zip(eager_losses, graph_losses))
    if lr0:
        equal = bitwise
        verdict = ("every step's loss bitwise equal" if equal else
                   "loss differs at step " + str(next(i for i, (a, b) in
                                                      enumerate(zip(eager_losses, graph_losses))
                                                      if a != b)))
    else:
        rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager_losses, graph_losses))
        equal = rel <= tolerance
        verdict = f"max relative loss difference {rel:.3g} (tolerance {tolerance:g})"
    passed = equal and grad_max == grad_max and stats["totals"]["fallback"] == 0
    if stats["totals"]["fallback"]:
        verdict += f"; {stats['totals']['fallback']} fallbacks"
    if ref is not None and not ref["passed"]:
        passed = False
        verdict += f"; logits vs {reference} max-abs {ref['max_abs']:.3g} over {ref['tolerance']}"
    result = {"profile": prof.name, "source": spec.source, "lr": lr, "lr0": lr0,
              "scopes": run.scopes, "pool": run.pool, "moe_mode": prof.moe.mode,
              "steps": steps, "eager_losses": eager_losses, "graph_losses": graph_losses,
              "bitwise_equal": bitwise, "grad_max_abs": grad_max, "grad_worst": grad_worst,
              "grads_compared": "every step" if side_by_side else "last step",
              "counters": stats["totals"], "reference": ref, "passed": passed,
              "verdict": verdict, "graphs": backend_name, **overflow, **device_info()}
    if rt is None:
        return result
    del eager_model, eager_trainer
    return _merge_distributed(spec, result, rt, lr, steps, tolerance, reference)


def _merge_distributed(spec, result, rt, lr, steps, tolerance, reference) -> dict | None:
    from ..distributed.context import merge_ranks

    docs = rt.gather_all(result)
    gc.collect()
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
    merged = merge_ranks(docs, rt) if rt.rank == 0 else None
    single = None
    if reference == "single" and rt.rank == 0:
        single = _single_reference(spec, docs, lr, steps, tolerance, rt)
    rt.barrier()  # the other ranks wait while rank 0 trains the single-process reference
    if rt.rank != 0:
        return None
    failing = [d for d in docs if not d["passed"]]
    merged["passed"] = not failing and (single is None or single["passed"])
    if failing:
        r = docs.index(failing[0])
        merged["verdict"] = f"rank {r}: {failing[0]['verdict']}"
    else:
        merged["verdict"] = f"every rank: {docs[0]['verdict']}"
    if single is not None:
        merged["reference"] = single
        merged["verdict"] += f"; {single['verdict']}"
    return merged


def _single_reference(spec, docs, lr, steps, tolerance, rt) -> dict:
    """The same global batches in one process on this rank's device: per-step losses against
    the distributed mean loss (the eager run's; the graph run's equals it at lr 0)."""
    prof, run = spec.profile, spec.profile.run
    torch.manual_seed(run.seed)
    model = build_model(spec, rt.device)
    trainer = Trainer(model, lr, run.weight_decay)
    it = batches(prof.model.vocab_size, run.batch * rt.world, run.seq_len, run.seed, rt.device,
                 run.data)
    losses = [float(trainer.step(next(it))) for _ in range(steps)]
    dist_losses = [sum(d["eager_losses"][i] for d in docs) / len(docs) for i in range(steps)]
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses, dist_losses))
    del model, trainer
    return {"kind": "single", "single_losses": losses, "distributed_losses": dist_losses,
            "max_rel": rel, "tolerance": tolerance, "passed": rel <= tolerance,
            "verdict": f"single process vs {rt.world} ranks: max relative loss difference "
                       f"{rel:.3g} (tolerance {tolerance:g})"}
