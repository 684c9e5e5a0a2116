"""Per-peer loads of the bounded EP dispatch: what `moe.ep_capacity_factor` must cover (CPU).

    python benchmarks/ep_capacity.py --out benchmarks/results/ep_capacity.json [--steps 20]

The all-to-all of moe/ep.py sends a token once to each rank that owns one of its experts, with
C = ceil(f * T * d / P) rows per (source, destination) pair. For a routing split over P ranks
of T tokens, a pair (s, d) needs n_sd rows (source s's tokens with a route to d); the factor
that pair needs is n_sd / (T * d / P). Recorded per routing, P and T: the largest factor any
pair needed (`max_factor`, over pairs, layers and batches), the mean (about 1 when balanced),
and max/mean rows over the pairs (`max_over_mean`); `overflow_at` gives, for a few f, the
share of (layer, batch) calls that would overflow somewhere, i.e. be redone.

Routings:
- `tiny_seeded` / `tiny_trained`: the routers of tiny-qwen3-moe (E = 8, k = 2), seeded, then
  after --steps AdamW steps (fp32, lr 1e-3) on synthetic batches; routing recorded on fresh
  batches (forward only);
- `uniform`: k distinct experts uniform at random, the sampling noise alone;
- `zipf_s`: expert i drawn with weight 1 / (i + 1)^s (without replacement), skewed routers;
  each at E = 8, k = 2 (the tiny model) and at E = 128, k = 8 (qwen3-30b-a3b).

`redo`: what an overflowed step costs. Two gloo ranks (ep 2) train tiny-qwen3-moe in fp32 at
2 x 32 tokens a rank (CPU wall time, medians): the bounded all-to-all without overflow
(seeded router, factor 8), the same with every step overflowing and redone (a router that
adds +8 to experts 0-1 for most tokens, factor 1), and that skewed router through the
all-gather alone (what the redo runs), one step of each in turn.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import torch

from moegraph_cli.moe.ep_sizing import distinct_ranks, peer_capacity

FACTORS = (1.0, 1.1, 1.25, 1.5, 2.0)


def pair_rows(ids_NK: torch.Tensor, ep: int, num_experts: int, tokens: int) -> torch.Tensor:
    """[P, P] rows pair (s, d) needs, the first P * T tokens split into P sources of T."""
    dest = ids_NK[:ep * tokens] // (num_experts // ep)
    needs = torch.zeros(ep * tokens, ep, dtype=torch.bool).scatter_(1, dest, True)
    return needs.view(ep, tokens, ep).sum(1)


def summarise(calls: list[torch.Tensor], ep: int, tokens: int, top_k: int,
              num_experts: int) -> dict:
    share = tokens * distinct_ranks(ep, top_k, num_experts) / ep
    rows = torch.stack([pair_rows(ids, ep, num_experts, tokens) for ids in calls]).float()
    per_call_max = rows.flatten(1).max(1).values
    over = {str(f): float((per_call_max > peer_capacity(tokens, top_k, ep, num_experts, f))
                          .float().mean()) for f in FACTORS}
    return {"ep": ep, "tokens": tokens, "calls": len(calls), "balanced_share": share,
            "max_factor": float(rows.max() / share), "mean_factor": float(rows.mean() / share),
            "max_over_mean": float((rows.flatten(1).max(1).values
                                    / rows.flatten(1).mean(1)).max()),
            "overflow_at": over}


def synthetic(kind: str, n: int, top_k: int, num_experts: int, gen) -> torch.Tensor:
    if kind == "uniform":
        weights = torch.ones(num_experts, dtype=torch.float64)
    else:
        s = float(kind.split("_")[1])
        weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    return torch.multinomial(weights.expand(n, num_experts), top_k, replacement=False,
                             generator=gen)


def model_routing(steps: int, tokens_needed: int, batches_kept: int) -> dict[str, list]:
    """Top-k ids of every MoE layer of tiny-qwen3-moe, seeded and after `steps` steps."""
    from moegraph_cli.models import MoeCausalLM
    from moegraph_cli.models.common import ffn
    from moegraph_cli.train.runspec import resolve
    from moegraph_cli.train.trainer import Trainer, batches

    prof = resolve("tiny-qwen3-moe", None, ["run.dtype=float32", "run.device=cpu"]).profile
    model = MoeCausalLM.from_config(prof.model, prof.moe, 0, "float32", torch.device("cpu"))
    seen: list[torch.Tensor] = []
    plain = ffn.route

    def recording(*args):
        out = plain(*args)
        seen.append(out[0].detach().clone())
        return out

    def record(seed: int) -> list[torch.Tensor]:
        """`batches_kept` calls per layer of `tokens_needed` tokens, run 4096 at a time."""
        calls = []
        it = batches(prof.model.vocab_size, 8, 512, seed, "cpu")
        ffn.route = recording
        try:
            for _ in range(batches_kept):
                chunks = []
                with torch.no_grad():
                    for _ in range(-(-tokens_needed // 4096)):
                        seen.clear()
                        model(next(it))
                        chunks.append(list(seen))
                calls += [torch.cat(layer) for layer in zip(*chunks)]
        finally:
            ffn.route = plain
        return calls

    out = {"tiny_seeded": record(101)}
    trainer = Trainer(model, 1e-3)
    it = batches(prof.model.vocab_size, 4, 128, 7, "cpu")
    for _ in range(steps):
        trainer.step(next(it))
    out["tiny_trained"] = record(202)
    return out




REDO_CASES = {"bounded": (False, ["moe.ep_dispatch=all_to_all", "moe.ep_capacity_factor=8.0"]),
              "bounded_overflow_redo": (True, ["moe.ep_dispatch=all_to_all",
                                               "moe.ep_capacity_factor=1.0"]),
              "all_gather_skewed": (True, ["moe.ep_dispatch=all_gather"])}


def _redo_rank(rank: int, world: int, port: int, steps: int, out_file: str) -> None:
    """The three cases side by side, one step of each in turn (a loaded CPU's noise falls on
    all three alike); per case the median step and the median forward + backward pass."""
    import os
    import statistics
    import time

    import torch.distributed as dist

    from moegraph_cli.distributed.runtime import setup
    from moegraph_cli.models.common import ffn
    from moegraph_cli.moe.routing import skewed_route
    from moegraph_cli.train.harness import make_trainer
    from moegraph_cli.train.runspec import build_model, resolve
    from moegraph_cli.train.trainer import batches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    plain = ffn.route
    rt = setup(world, 8, "cpu", 300)
    runs, step_ms, pass_ms = {}, {}, {}
    for name, (skew, opts) in REDO_CASES.items():
        spec = resolve("tiny-qwen3-moe", None, ["run.device=cpu", "run.dtype=float32",
                                                "run.seq_len=32", *opts])
        torch.manual_seed(0)
        model = build_model(spec, rt.device, rt=rt)
        trainer = make_trainer(model, 1e-4, 0.0, rt)
        passes = pass_ms.setdefault(name, [])

        def timed(ids, fb=trainer._forward_backward, passes=passes):
            t0 = time.perf_counter()
            loss = fb(ids)
            passes.append((time.perf_counter() - t0) * 1e3)
            return loss

        trainer._forward_backward = timed
        it = batches(spec.profile.model.vocab_size, 2, 32, 0, "cpu", rank=rank, world=world)
        runs[name] = (skew, trainer, it)
        step_ms[name] = []
    for step in range(steps + 1):  # the first step of each is a warm-up
        for name, (skew, trainer, it) in runs.items():
            ffn.route = skewed_route if skew else plain
            dist.barrier()
            t0 = time.perf_counter()
            trainer.step(next(it))
            if step:
                step_ms[name].append((time.perf_counter() - t0) * 1e3)
    ffn.route = plain
    result = {name: {"step_ms": statistics.median(step_ms[name]),
                     "pass_ms": statistics.median(pass_ms[name]),
                     "passes_per_step": len(pass_ms[name]) / (steps + 1),
                     **trainer.overflow.report()}
              for name, (_, trainer, _) in runs.items()}
    if rank == 0:
        Path(out_file).write_text(json.dumps(result))
    dist.destroy_process_group()


def redo_cost(steps: int) -> dict:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "redo.json")
        mp.spawn(_redo_rank, args=(2, port, steps, out_file), nprocs=2, join=True)
        cases = json.loads(Path(out_file).read_text())
    plain = cases["bounded"]["step_ms"]
    return {"world": 2, "ep": 2, "tokens_per_rank": 64, "dtype": "float32", "steps": steps,
            "cases": cases, "redo_over_plain": cases["bounded_overflow_redo"]["step_ms"] / plain,
            "redo_over_all_gather": cases["bounded_overflow_redo"]["step_ms"]
            / cases["all_gather_skewed"]["step_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--redo-steps", type=int, default=8)
    args = ap.parse_args()
    redo = redo_cost(args.redo_steps)
    print(json.dumps(redo))
    gen = torch.Generator().manual_seed(0)
    records = []
    tiny_tokens = (256, 1024, 4096)
    routed = model_routing(args.steps, 8 * max(tiny_tokens), args.batches)
    for name, calls in routed.items():
        for ep in (2, 4, 8):
            for tokens in tiny_tokens:
                records.append({"routing": name, "experts": 8, "top_k": 2,
                                **summarise(calls, ep, tokens, 2, 8)})
    for num_experts, top_k, eps, tiny in ((8, 2, (2, 4, 8), True),
                                          (128, 8, (8, 16, 64), False)):
        for kind in ("uniform", "zipf_0.5", "zipf_1.0") + (("zipf_1.5",) if tiny else ()):
            for ep in eps:
                for tokens in (256, 1024, 4096):
                    calls = [synthetic(kind, ep * tokens, top_k, num_experts, gen)
                             for _ in range(2 * args.batches)]
                    records.append({"routing": kind, "experts": num_experts, "top_k": top_k,
                                    **summarise(calls, ep, tokens, top_k, num_experts)})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    doc = {"what": "per-peer rows of the bounded EP all-to-all over a balanced share "
                   "T * d / P (moe/ep.py); CPU", "date": datetime.date.today().isoformat(),
           "torch": str(torch.__version__), "commit": commit,
           "command": f"python benchmarks/ep_capacity.py --out {args.out} --steps "
                      f"{args.steps} --batches {args.batches} --redo-steps {args.redo_steps}",
           "train_steps": args.steps, "redo": redo, "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in records:
        print(f"{r['routing']:>13} E={r['experts']:<3} k={r['top_k']} P={r['ep']:<3} "
              f"T={r['tokens']:<5} max {r['max_factor']:.3f} mean {r['mean_factor']:.3f} "
              f"over@1.25 {r['overflow_at']['1.25']:.2f} over@1.5 {r['overflow_at']['1.5']:.2f}")


if __name__ == "__main__":
    main()
