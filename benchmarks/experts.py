"""The expert path on one GPU against its baseline, forward and forward + backward, eager and
CUDA-graphed, in TFLOP/s.

    python3 benchmarks/experts.py [--shapes qwen3,mixtral,deepseek-v3-64e]
        [--tokens 1024,8192,32768] [--routing uniform,skewed] [--skew 0.25]
        [--impls permute_free,grouped_mm_baseline,permute_free_keep] [--no-graph]
        [--sequential] [--check] [--kernels] [--out PATH]

What is compared: moegraph's permute-free experts (`moegraph_cli.moe.experts.permute_free_moe`:
the route list built on the device, FC1 + SwiGLU gathering token rows by slot, FC2, a
gather-combine; the backward through the same kernels) against permute + `torch._grouped_mm`
+ unpermute (argsort the routes by expert, gather, grouped GEMM FC1, SwiGLU x p, grouped GEMM
FC2, scatter back, sum over k). Same math, bf16 with fp32 accumulation; weights N(0, 0.02).

How, per (shape, T, routing, impl):
- eager fwd and fwd+bwd: `reps` calls back to back between one pair of CUDA events (no sync
  inside, so host launch work overlaps the GPU's as in training), the median of `--rounds`
  such rounds after warm-up; bwd = (fwd+bwd) - fwd;
- graphed fwd and fwd+bwd: one call captured in a CUDA graph (the backward as autograd.grad
  into fresh buffers, as a captured backward does), replayed back to back, the same medians;
- the four timings' rounds interleaved (round r runs each in turn, the order shuffled a round,
  common.round_orders),
  each with the median SM clock NVML read while its rounds ran (`sm_mhz`): under its power
  cap the GPU's clock drifts as it warms, so that timed one after another (`--sequential`,
  the method of the results made before this option) the drift favours whichever ran first;
- TFLOP/s from useful FLOPs only: forward 2 N H 3F with N = T k routes (padding rows not
  counted), backward twice that;
- peak memory of one eager fwd+bwd above what the inputs hold.
Routing (--routing, one or both): router logits -> softmax -> top-k, the weights from the
softmax. `uniform`: logits N(0, 1), every expert equally likely (Qwen3 shape, T = 8192: the
busiest expert gets 1.1x the mean load). `skewed`: plus a fixed per-expert bias --skew x
N(0, 1), a trained router's preferences (at 0.25, the same shape: the busiest expert 2.8x the
mean, the idlest 0.13x). Each record carries its load statistics.
A case that fails (out of memory, a missing op, a refused capture) is recorded with its error
and the run goes on. The kernels' fallback to the pointer path is switched off, so a variant
that fails is an error, not a slower figure; each record names the kernel variants that ran
(`kernel_plans`).
--check first compares both impls' outputs and gradients with an fp32 reference on a small
case with skewed routing (exit 1 if the permute-free path is more than 2e-2 off, relative).
--kernels adds the profiler's GPU ms per kernel of one eager fwd+bwd (where the time goes),
and of one replay of the graphed fwd+bwd.

Writes experts.json (--out; default $OUT/experts.json, else benchmarks/results/experts.json).
"""

from __future__ import annotations

import argparse
import math
import sys

from common import (capture_graph, default_out, environment, error_text, interleaved_ms,
                    kernel_ms, throughput_ms, write_json)

SHAPES = {  # name: (experts E, hidden H, expert ffn F, top k)
    "qwen3": (128, 2048, 768, 8),
    "mixtral": (8, 4096, 14336, 2),
    "deepseek-v3-64e": (64, 7168, 2048, 8),
}


def make_routing(T, E, k, routing, skew, seed=0):
    """(topk_ids [T, k] int64, topk_weights [T, k] fp32) on the CPU, seeded."""
    import torch
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed))
    if routing == "skewed":
        bias = torch.randn(E, generator=torch.Generator().manual_seed(seed + 1))
        logits = logits + skew * bias
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    return ids, weights


def load_stats(ids, E) -> dict:
    import torch
    counts = torch.bincount(ids.reshape(-1), minlength=E).float()
    mean = counts.mean()
    return {"max_over_mean": round(float(counts.max() / mean), 3),
            "min_over_mean": round(float(counts.min() / mean), 3),
            "cv": round(float(counts.std() / mean), 3), "empty_experts": int((counts == 0).sum())}


def make_case(dims, T, routing, skew, seed=0):
    """(x, ids, weights, w_gate_up, w_down) on the GPU, the four float ones leaves that
    require grad, and dout; dims = (E, H, F, k)."""
    import torch
    E, H, F, k = dims
    dev, bf = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(seed)
    ids, w = make_routing(T, E, k, routing, skew, seed)
    x = torch.randn(T, H, device=dev, generator=gen).to(bf).requires_grad_()
    w_gate_up = (torch.randn(E, 2 * F, H, device=dev, generator=gen) * 0.02).to(bf)
    w_down = (torch.randn(E, H, F, device=dev, generator=gen) * 0.02).to(bf)
    dout = torch.randn(T, H, device=dev, generator=gen).to(bf)
    return (x, ids.to(dev), w.to(dev, bf).requires_grad_(), w_gate_up.requires_grad_(),
            w_down.requires_grad_()), dout


def grouped_mm_moe(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF):
    """The baseline: argsort permute + gather, torch._grouped_mm FC1, SwiGLU * p, FC2, unpermute."""
    import torch
    import torch.nn.functional as F
    num_tokens, top_k = topk_ids_TK.shape
    num_experts, two_f, hidden = w_gate_up_EFH.shape
    ffn = two_f // 2
    ids_N = topk_ids_TK.reshape(-1)
    order = torch.argsort(ids_N, stable=True)
    ends = torch.searchsorted(ids_N[order], torch.arange(1, num_experts + 1, device=ids_N.device))
    offs = ends.to(torch.int32)
    xs = x_TH[order // top_k]
    y1 = torch._grouped_mm(xs, w_gate_up_EFH.transpose(-2, -1), offs=offs)
    p = topk_weights_TK.reshape(-1)[order, None].float()
    act = (F.silu(y1[:, :ffn].float()) * y1[:, ffn:].float() * p).to(x_TH.dtype)
    y2 = torch._grouped_mm(act, w_down_EHF.transpose(-2, -1), offs=offs)
    y_routes = torch.zeros_like(y2).index_copy(0, order, y2)
    return y_routes.view(num_tokens, top_k, hidden).float().sum(dim=1).to(x_TH.dtype)


IMPLS = ("permute_free", "grouped_mm_baseline")  # the default --impls
# permute_free_keep: the permute-free experts keeping FC1's activation for the backward (the MoE
# scope's `keep` mode, which a plan picks where memory allows; moe/experts.PermuteFreeMoE).
KNOWN_IMPLS = (*IMPLS, "permute_free_keep")


def impls() -> dict:
    import functools

    from moegraph_cli.moe.experts import permute_free_moe
    return {"permute_free": permute_free_moe, "grouped_mm_baseline": grouped_mm_moe,
            "permute_free_keep": functools.partial(permute_free_moe, keep_act=True)}


def fwd_flops(shape, T) -> int:
    E, H, F, k = SHAPES[shape]
    return 2 * T * k * H * 3 * F  # FC1 [H -> 2F] and FC2 [F -> H] per route


def estimate_bytes(shape, T) -> int:
    """Rough upper bound of the baseline's peak (bf16 tensors, fp32 SwiGLU temporaries)."""
    E, H, F, k = SHAPES[shape]
    per_route = 2 * H * 4 + 2 * F * (2 + 4 * 3) + F * (2 + 4 * 2)
    return 2 * 2 * (E * 3 * F * H) + T * k * per_route


def leaves_of(args):
    return [args[0], args[2], args[3], args[4]]


def time_case(fn, args, dout, reps, rounds, graphs, interleave=True) -> dict:
    """Eager and graphed ms of fwd and fwd+bwd (with `interleave`, their rounds interleaved,
    each with the median SM clock it ran at), and the eager fwd+bwd peak."""
    import torch
    leaves = leaves_of(args)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        fn(*args).backward(dout)

    bodies = {"fwd_ms": lambda: fn(*args), "fwd_bwd_ms": fwd_bwd}
    out = {}
    if not interleave:
        out.update({key: throughput_ms(body, reps, rounds) for key, body in bodies.items()})
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    out["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    for t in leaves:
        t.grad = None
    for key, body in (("graph_fwd_ms", lambda: fn(*args)),
                      ("graph_fwd_bwd_ms", lambda: torch.autograd.grad(fn(*args), leaves, dout))):
        if not graphs:
            break
        try:
            graph = capture_graph(body)
            if interleave:
                bodies[key] = graph.replay
            else:
                out[key] = throughput_ms(graph.replay, reps, rounds)
            del graph
        except Exception as exc:  # noqa: BLE001 - a path that cannot be captured: say why
            out[key] = None
            out.setdefault("graph_error", error_text(exc))
            torch.cuda.synchronize()
    if interleave:
        timed = interleaved_ms(bodies, reps, rounds)
        out.update({key: t["ms"] for key, t in timed.items()})
        out["sm_mhz"] = {key: t["sm_mhz"] for key, t in timed.items()}
    return out


def run_case(shape, T, routing, impl, args_ns) -> dict:
    import torch
    E, H, F, k = SHAPES[shape]
    rec = {"shape": shape, "E": E, "H": H, "F": F, "k": k, "T": T, "impl": impl,
           "routing": routing, "skew": args_ns.skew if routing == "skewed" else 0}
    limit = 0.92 * torch.cuda.get_device_properties(0).total_memory
    if estimate_bytes(shape, T) > limit:
        rec["error"] = f"skipped: estimated {estimate_bytes(shape, T) / 1e9:.0f} GB > " \
                       f"{limit / 1e9:.0f} GB"
        return rec
    work = 3 * fwd_flops(shape, T) / 1e12  # TFLOP of one fwd+bwd
    reps = max(3, min(20, math.ceil(40 / max(work, 1e-3))))
    case = dout = None
    try:
        case, dout = make_case(SHAPES[shape], T, routing, args_ns.skew)
        rec["load"] = load_stats(case[1], E)
        rec.update(reps=reps, rounds=args_ns.rounds)
        fn = impls()[impl]
        rec.update(time_case(fn, case, dout, reps, args_ns.rounds, not args_ns.no_graph,
                             not args_ns.sequential))
        flops = fwd_flops(shape, T)
        for mode in ("", "graph_"):
            fwd, both = rec.get(mode + "fwd_ms"), rec.get(mode + "fwd_bwd_ms")
            if fwd:
                rec[mode + "fwd_tflops"] = flops / fwd / 1e9
            if both:
                rec[mode + "fwd_bwd_tflops"] = 3 * flops / both / 1e9
        rec["bwd_ms"] = rec["fwd_bwd_ms"] - rec["fwd_ms"]
        if impl.startswith("permute_free"):
            from moegraph_kernels import gemm_launch
            rec["kernel_plans"] = {name: plan._asdict() for name, plan in
                                   gemm_launch.LAST_PLAN.items()}
        if args_ns.kernels:
            def once():
                for t in leaves_of(case):
                    t.grad = None
                fn(*case).backward(dout)
            rec["kernels_ms"] = kernel_ms(once)
            if not args_ns.no_graph:
                leaves = leaves_of(case)
                graph = capture_graph(lambda: torch.autograd.grad(fn(*case), leaves, dout))
                rec["graph_kernels_ms"] = kernel_ms(graph.replay)
                del graph
    except Exception as exc:  # noqa: BLE001 - OOM, a missing torch._grouped_mm: record it
        rec["error"] = error_text(exc)
    finally:
        del case, dout
        torch.cuda.empty_cache()
    return rec


def check(routing, skew) -> dict:
    """Both impls against an fp32 reference on a small case: relative Frobenius errors of
    y, dx, dp, dW_gate_up, dW_down."""
    import torch
    from moegraph_cli.moe.reference import reference_moe
    (x, ids, w, wgu, wd), dout = make_case((16, 512, 256, 4), 512, routing, skew, seed=1)
    ref_leaves = [t.detach().float().requires_grad_() for t in (x, w, wgu, wd)]
    y32 = reference_moe(ref_leaves[0], ids, *ref_leaves[1:])
    ref = [y32.detach(), *torch.autograd.grad(y32, ref_leaves, dout.float())]
    out = {}
    for name, fn in [("reference_bf16", reference_moe), *impls().items()]:
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, wgu, wd)]
        try:
            y = fn(leaves[0], ids, *leaves[1:])
            got = [y.detach(), *torch.autograd.grad(y, leaves, dout)]
            out[name] = [((g.double() - r.double()).norm() / r.double().norm()).item()
                         for g, r in zip(got, ref)]
        except Exception as exc:  # noqa: BLE001
            out[name] = error_text(exc)
        print(f"check {name:>20}: {out[name]}", file=sys.stderr)
    pf = out["permute_free"]
    out["ok"] = isinstance(pf, list) and max(pf) <= 2e-2
    return out


def print_table(records) -> None:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    print(f"{'shape':<16}{'T':>7} {'routing':<8} {'impl':<20}{'fwd ms':>8}{'f+b ms':>8}"
          f"{'graph fwd':>10}{'graph f+b':>10}{'fwd TF/s':>9}{'f+b TF/s':>9}"
          f"{'g f+b TF/s':>11}{'peak GB':>8}")
    for r in records:
        if "error" in r:
            print(f"{r['shape']:<16}{r['T']:>7} {r['routing']:<8} {r['impl']:<20}{r['error']}")
            continue
        print(f"{r['shape']:<16}{r['T']:>7} {r['routing']:<8} {r['impl']:<20}"
              f"{f(r['fwd_ms'], '8.3f')}"
              f"{f(r['fwd_bwd_ms'], '8.3f')}{f(r.get('graph_fwd_ms'), '10.3f')}"
              f"{f(r.get('graph_fwd_bwd_ms'), '10.3f')}{f(r.get('fwd_tflops'), '9.0f')}"
              f"{f(r.get('fwd_bwd_tflops'), '9.0f')}{f(r.get('graph_fwd_bwd_tflops'), '11.0f')}"
              f"{r['peak_bytes'] / 1e9:8.2f}")
    for key in sorted({(r["shape"], r["T"], r["routing"]) for r in records}):
        pair = {r["impl"]: r for r in records
                if (r["shape"], r["T"], r["routing"]) == key and "error" not in r}
        a, b = pair.get("permute_free"), pair.get("grouped_mm_baseline")
        if a and b:
            graphed = (f", graphed {b['graph_fwd_bwd_ms'] / a['graph_fwd_bwd_ms']:.2f}x"
                       if a.get("graph_fwd_bwd_ms") and b.get("graph_fwd_bwd_ms") else "")
            print(f"{key[0]} T={key[1]} {key[2]}: fwd+bwd {b['fwd_bwd_ms'] / a['fwd_bwd_ms']:.2f}x "
                  f"faster than the baseline eager{graphed}; peak memory "
                  f"{a['peak_bytes'] / b['peak_bytes']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of %(default)s")
    ap.add_argument("--tokens", default="1024,8192,32768", help="comma list of T")
    ap.add_argument("--routing", default="uniform", help="comma list of uniform, skewed")
    ap.add_argument("--skew", type=float, default=0.25,
                    help="std of the per-expert logit bias with --routing skewed")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help=f"comma list of {', '.join(KNOWN_IMPLS)} (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (median)")
    ap.add_argument("--no-graph", action="store_true", help="eager timings only")
    ap.add_argument("--sequential", action="store_true",
                    help="time eager fwd, fwd+bwd, graphed fwd, fwd+bwd one after another "
                         "(the method before interleaved rounds)")
    ap.add_argument("--check", action="store_true", help="fp32-reference check first")
    ap.add_argument("--kernels", action="store_true", help="per-kernel GPU ms of a fwd+bwd")
    ap.add_argument("--out", default=str(default_out("experts.json")))
    args = ap.parse_args()
    for given, known in ((args.shapes, SHAPES), (args.impls, KNOWN_IMPLS),
                         (args.routing, ("uniform", "skewed"))):
        unknown = [n for n in given.split(",") if n not in known]
        if unknown:
            ap.error(f"unknown {unknown[0]!r}; known: {', '.join(known)}")
    import torch
    if not torch.cuda.is_available():
        sys.exit("benchmarks/experts.py: needs a CUDA GPU")
    from moegraph_kernels import gemm_launch
    gemm_launch.FALLBACK_ON_ERROR = False  # a failing variant is an error here, not a fallback
    doc = {"benchmark": "experts", **environment(), "records": []}
    if args.check:
        doc["check"] = check("skewed", args.skew)
        if not doc["check"]["ok"]:
            write_json(args.out, doc)
            sys.exit("benchmarks/experts.py: the permute-free path failed --check")
    for shape in args.shapes.split(","):
        for T in (int(t) for t in args.tokens.split(",")):
            for routing in args.routing.split(","):
                for impl in args.impls.split(","):
                    doc["records"].append(run_case(shape, T, routing, impl, args))
                    write_json(args.out, doc)
    print_table(doc["records"])


if __name__ == "__main__":
    main()
