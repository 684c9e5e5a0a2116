"""`moegraph verify`: eager against graph on the same batches, from the same weights.

With `--lr0` the learning rate is 0, so the weights never change and every step's loss must
be bitwise equal between the eager and the graphed model; gradients are compared element by
element (max-abs reported). With lr > 0 the loss curves must agree within a relative
tolerance. `--reference transformers` also compares the logits with transformers'
Qwen3MoeForCausalLM loaded from the same weights.
"""

from __future__ import annotations

import torch

from .capability import check_capturable
from .errors import NotCapturableError
from .harness import GraphTrainer, build_session, capture_into, device_info
from .render import Progress
from .runspec import RunSpec, build_model, pick_device
from .summary import static_memory
from .train import batches


def _grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> tuple[float, str]:
    worst, where = 0.0, "-"
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if pa.grad is None or pb.grad is None:
            continue
        d = (pa.grad.float() - pb.grad.float()).abs().max().item()
        if d != d:  # NaN
            return float("nan"), name
        if d > worst:
            worst, where = d, name
    return worst, where


def verify_command(spec: RunSpec, lr0: bool = True, steps: int = 6, tolerance: float = 2e-2,
                   reference: str | None = None, progress: bool = True) -> dict:
    prof, run = spec.profile, spec.profile.run
    device = pick_device(run.device, need_cuda=True)
    check_capturable(prof)
    lr = 0.0 if lr0 else run.lr
    free, _ = torch.cuda.mem_get_info(device)
    side_by_side = 2.5 * static_memory(prof.model, run.dtype)["total"] < free

    def make():
        torch.manual_seed(run.seed)
        model = build_model(spec, device)
        return model, GraphTrainer(model, lr, run.weight_decay)

    def batch_iter():
        return batches(prof.model.vocab_size, run.batch, run.seq_len, run.seed, device, run.data)

    eager_losses, graph_losses, grad_max, grad_worst = [], [], 0.0, "-"
    with Progress(progress, 2 * steps + 1, "verify") as bar:
        graph_model, graph_trainer = make()
        gi = batch_iter()
        session = build_session(graph_model, run.scopes, run.pool)
        first = next(batch_iter())
        if not capture_into(graph_model, session, first):
            failure = session.failure
            session.uninstall()
            raise NotCapturableError(f"capture failed: {failure}")
        graph_trainer.session = session
        bar.advance("steps")
        if side_by_side:
            eager_model, eager_trainer = make()
            ei = batch_iter()
            for _ in range(steps):
                eager_losses.append(float(eager_trainer.step(next(ei))))
                graph_losses.append(float(graph_trainer.step(next(gi))))
                d, w = _grad_diff(eager_model, graph_model)
                if d > grad_max or d != d:
                    grad_max, grad_worst = d, w
                bar.advance()
                bar.advance()
        else:
            # Not enough memory for two models: graph run first, keep its last-step grads on
            # the host, then the eager run; losses are compared every step, grads at the last.
            for _ in range(steps):
                graph_losses.append(float(graph_trainer.step(next(gi))))
                bar.advance()
            saved = {n: p.grad.detach().to("cpu") for n, p in graph_model.named_parameters()}
            stats_only = session.stats()
            session.uninstall()
            del graph_model, graph_trainer
            torch.cuda.empty_cache()
            eager_model, eager_trainer = make()
            ei = batch_iter()
            for _ in range(steps):
                eager_losses.append(float(eager_trainer.step(next(ei))))
                bar.advance()
            for n, p in eager_model.named_parameters():
                d = (p.grad.detach().float().cpu() - saved[n].float()).abs().max().item()
                if d > grad_max or d != d:
                    grad_max, grad_worst = d, n
    stats = session.stats() if side_by_side else stats_only
    ref = None
    if reference:
        from .reference_check import logits_parity
        ref = logits_parity(eager_model, first, reference)

    if lr0:
        equal = all(a == b for a, b in zip(eager_losses, graph_losses))
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
    session.uninstall()
    return {"profile": prof.name, "source": spec.source, "lr": lr, "lr0": lr0,
            "scopes": run.scopes, "pool": run.pool, "moe_mode": prof.moe.mode,
            "steps": steps, "eager_losses": eager_losses, "graph_losses": graph_losses,
            "bitwise_equal": all(a == b for a, b in zip(eager_losses, graph_losses)),
            "grad_max_abs": grad_max, "grad_worst": grad_worst,
            "grads_compared": "every step" if side_by_side else "last step",
            "counters": stats["totals"], "reference": ref, "passed": passed,
            "verdict": verdict, **device_info()}
