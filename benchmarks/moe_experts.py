"""Expert-path benchmark on one GPU: permute_free (Triton) vs permute + torch._grouped_mm.

    python benchmarks/moe_experts.py [--shapes qwen3,mixtral,deepseek-v3-64e]
        [--tokens 1024,8192,32768] [--quick] [--check] [--sweep] [--out PATH]

Times forward and backward separately (CUDA events, median after warm-up), peak memory of one
forward+backward above the inputs' baseline, and TFLOP/s from useful FLOPs
(forward 2*N*H*2F + 2*N*F*H with N = T*k routes, backward twice that). Routing: random router
logits -> softmax -> top-k; weights ~ N(0, 0.02) in bf16. A case that fails (OOM, a missing
op) is recorded with its error and the run goes on. The last lines are a table; the records go
to --out as JSON. --sweep times a few tile configs of every GEMM at one shape and prints the
fastest; --check compares both impls with an fp32 reference on a small case first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from moegraph_cli.moe.experts import (build_routes, permute_free_moe,  # noqa: E402
                                      tile_configs)
from moegraph_cli.moe.reference import reference_moe  # noqa: E402
from moegraph_kernels.gather_gemm import (GemmConfig, dact_swiglu, dp_tiles,  # noqa: E402
                                          fc1_swiglu, slot_gemm)
from moegraph_kernels.wgrad import expert_wgrad  # noqa: E402

SHAPES = {  # name: (E, H, F, k)
    "qwen3": (128, 2048, 768, 8),
    "mixtral": (8, 4096, 14336, 2),
    "deepseek-v3-64e": (64, 7168, 2048, 8),
}
MEMORY_LIMIT = 130e9


def grouped_mm_moe(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF):
    """Baseline: argsort permute + gather, torch._grouped_mm FC1, SwiGLU*p, FC2, unpermute."""
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


IMPLS = {"permute_free": permute_free_moe, "grouped_mm_baseline": grouped_mm_moe}


def make_case(E, H, F_, k, T, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype).requires_grad_()
    logits = torch.randn(T, E, device="cuda", generator=gen)
    w, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    w = w.to(dtype).requires_grad_()
    w_gate_up = (torch.randn(E, 2 * F_, H, device="cuda", generator=gen) * 0.02).to(dtype)
    w_down = (torch.randn(E, H, F_, device="cuda", generator=gen) * 0.02).to(dtype)
    dout = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    return x, ids, w, w_gate_up.requires_grad_(), w_down.requires_grad_(), dout


def fwd_flops(E, H, F_, k, T):
    return 2 * T * k * H * 2 * F_ + 2 * T * k * F_ * H


def estimate_bytes(E, H, F_, k, T):
    """Rough upper bound of the baseline's peak (bf16 tensors, fp32 SwiGLU temporaries)."""
    n = T * k
    weights = 2 * 2 * (E * 3 * F_ * H)  # params + grads, bf16
    per_route = 2 * H * 4 + 2 * F_ * (2 + 4 * 3) + F_ * (2 + 4 * 2)
    return weights + n * per_route


def time_fwd_bwd(fn, args, dout, reps, warmup=2):
    """Throughput timing: `reps` back-to-back forwards, then `reps` back-to-back
    forward+backward pairs, each bracketed by one pair of CUDA events with no sync inside, so
    host launch latency overlaps GPU work as it does in training. bwd = (fwd+bwd) - fwd."""
    leaves = [args[0], args[2], args[3], args[4]]

    def fwd_only():
        return fn(*args)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        fn(*args).backward(dout)

    for _ in range(warmup):
        fwd_bwd()
    torch.cuda.synchronize()
    times = {}
    for name, body in (("fwd", fwd_only), ("both", fwd_bwd)):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            body()
        e1.record()
        torch.cuda.synchronize()
        times[name] = e0.elapsed_time(e1) / reps
    return times["fwd"], times["both"] - times["fwd"]


def peak_fwd_bwd(fn, args, dout):
    for t in (args[0], args[2], args[3], args[4]):
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = fn(*args)
    y.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del y
    return peak


def run_case(shape, T, impl, reps, env):
    E, H, F_, k = SHAPES[shape]
    rec = dict(shape=shape, T=T, impl=impl, fwd_ms=None, bwd_ms=None, peak_bytes=None,
               tflops=None, **env)
    est = estimate_bytes(E, H, F_, k, T)
    if est > MEMORY_LIMIT:
        rec["error"] = f"skipped: estimated {est / 1e9:.0f} GB > {MEMORY_LIMIT / 1e9:.0f} GB"
        return rec
    args = dout = None
    try:
        x, ids, w, wgu, wd, dout = make_case(E, H, F_, k, T)
        args = (x, ids, w, wgu, wd)
        fn = IMPLS[impl]
        fwd_ms, bwd_ms = time_fwd_bwd(fn, args, dout, reps)
        peak = peak_fwd_bwd(fn, args, dout)
        flops = fwd_flops(E, H, F_, k, T)
        rec.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, peak_bytes=peak,
                   tflops=3 * flops / (fwd_ms + bwd_ms) / 1e9,
                   fwd_tflops=flops / fwd_ms / 1e9, bwd_tflops=2 * flops / bwd_ms / 1e9)
    except Exception as exc:  # OOM, a missing torch._grouped_mm, a compile failure: record it
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    finally:
        del args, dout
        torch.cuda.empty_cache()
    return rec


def check():
    """Both impls against an fp32 reference on a small case; relative Frobenius errors."""
    E, H, F_, k, T = 16, 512, 256, 4, 512
    x, ids, w, wgu, wd, dout = make_case(E, H, F_, k, T, seed=1)
    leaves32 = [t.detach().float().requires_grad_() for t in (x, w, wgu, wd)]
    y32 = reference_moe(leaves32[0], ids, leaves32[1], leaves32[2], leaves32[3])
    ref = [y32.detach(), *torch.autograd.grad(y32, leaves32, dout.float())]
    ok = True
    for impl, fn in [("reference_bf16", reference_moe), *IMPLS.items()]:
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, wgu, wd)]
        try:
            y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
            got = [y.detach(), *torch.autograd.grad(y, leaves, dout)]
        except Exception as exc:
            print(f"check {impl}: {type(exc).__name__}: {exc}")
            ok = ok and impl != "permute_free"
            continue
        errs = [((g.double() - r.double()).norm() / r.double().norm()).item()
                for g, r in zip(got, ref)]
        print(f"check {impl:>20}: rel err y/dx/dp/dWgu/dWd = "
              + " ".join(f"{e:.2e}" for e in errs))
        if impl == "permute_free" and max(errs) > 2e-2:
            ok = False
    print("check:", "ok" if ok else "FAILED")
    return ok


def bench_kernel(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


SWEEP_CONFIGS = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages)
    GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 4),
    GemmConfig(128, 256, 64, 8, 8, 3), GemmConfig(128, 64, 64, 8, 4, 4),
    GemmConfig(64, 128, 64, 8, 4, 4), GemmConfig(128, 128, 32, 8, 8, 5),
    GemmConfig(64, 256, 64, 8, 8, 3),
]


def smem_bytes(cfg, b_tiles=1):
    return (cfg.block_m * cfg.block_k + b_tiles * cfg.block_n * cfg.block_k) * 2 * cfg.num_stages


def sweep(shape, T, env):
    """Time every GEMM under each candidate tile config; print the fastest of each."""
    E, H, F_, k = SHAPES[shape]
    x, ids, w, wgu, wd, dout = make_case(E, H, F_, k, T)
    x, w, wgu, wd = (t.detach() for t in (x, w, wgu, wd))
    n = T * k
    records = []
    for route_block in (128, 64):
        routes = build_routes(ids, w, E, route_block, None)
        S = routes.num_slots
        w_N = w.reshape(-1)
        y1 = torch.empty(S, 2 * F_, device="cuda", dtype=x.dtype)
        act = torch.empty(S, F_, device="cuda", dtype=x.dtype)
        y2 = torch.empty(S, H, device="cuda", dtype=x.dtype)
        dy1 = torch.empty_like(y1)
        dw_down, dw_gu = torch.empty_like(wd), torch.empty_like(wgu)
        fc1_swiglu(x, wgu, w_N, routes, y1, act)

        def make(kernel, cfg):
            if kernel == "fc1":
                return lambda: fc1_swiglu(x, wgu, w_N, routes, y1, act, cfg)
            if kernel == "fc2":
                return lambda: slot_gemm(act, wd, routes, y2, w_nk=True, cfg=cfg)
            if kernel == "dact":
                dp = torch.empty(S, dp_tiles(F_, cfg), device="cuda")
                return lambda: dact_swiglu(dout, wd, y1, w_N, routes, dy1, act, dp, cfg)
            if kernel == "dx":
                return lambda: slot_gemm(dy1, wgu, routes, y2, w_nk=False, cfg=cfg)
            if kernel == "wgrad_down":
                return lambda: expert_wgrad(dout, act, routes, dw_down, True, False, cfg)
            return lambda: expert_wgrad(dy1, x, routes, dw_gu, False, True, cfg)

        flops = {"fc1": 2 * n * H * 2 * F_, "fc2": 2 * n * F_ * H, "dact": 2 * n * H * F_,
                 "dx": 2 * n * 2 * F_ * H, "wgrad_down": 2 * n * H * F_,
                 "wgrad_gate_up": 2 * n * 2 * F_ * H}
        for kernel in flops:
            best = None
            for cfg in SWEEP_CONFIGS:
                if cfg.block_m > route_block and not kernel.startswith("wgrad"):
                    continue
                if kernel.startswith("wgrad") and route_block != 128:
                    continue
                if smem_bytes(cfg, 2 if kernel == "fc1" else 1) > 220 * 1024:
                    continue
                rec = dict(shape=shape, T=T, impl=f"sweep:{kernel}", route_block=route_block,
                           config=list(cfg), fwd_ms=None, bwd_ms=None, peak_bytes=None,
                           tflops=None, **env)
                try:
                    ms = bench_kernel(make(kernel, cfg))
                    rec.update(kernel_ms=ms, tflops=flops[kernel] / ms / 1e9)
                    if best is None or ms < best[0]:
                        best = (ms, cfg)
                except Exception as exc:
                    rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                records.append(rec)
                print(f"sweep {kernel:>14} route_block={route_block:<3} {tuple(cfg)}: "
                      + (f"{rec['kernel_ms']:.3f} ms {rec['tflops']:.0f} TFLOP/s"
                         if "kernel_ms" in rec else rec["error"]))
            if best:
                print(f"BEST {kernel} route_block={route_block}: {tuple(best[1])} "
                      f"{best[0]:.3f} ms ({flops[kernel] / best[0] / 1e9:.0f} TFLOP/s)")
        print("default configs:", tile_configs(n, E, H, F_, torch.device("cuda")))
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--quick", action="store_true", help="qwen3 only, T=1024,8192, fewer reps")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="tile-config sweep at --sweep-shape")
    ap.add_argument("--sweep-shape", default="qwen3:8192")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_experts.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_experts: needs a CUDA GPU")

    now = datetime.datetime.now().isoformat(timespec="seconds")
    env = dict(gpu=torch.cuda.get_device_name(), torch=str(torch.__version__),
               triton=triton.__version__, date=now)
    records = []
    if args.check and not check():
        sys.exit(1)
    if args.sweep:
        shape, T = args.sweep_shape.split(":")
        records += sweep(shape, int(T), env)
    shapes = ["qwen3"] if args.quick else args.shapes.split(",")
    tokens = [1024, 8192] if args.quick else [int(t) for t in args.tokens.split(",")]
    for shape in shapes:
        for T in tokens:
            E, H, F_, k = SHAPES[shape]
            work = 3 * fwd_flops(E, H, F_, k, T) / 1e12  # TFLOP per fwd+bwd
            reps = 2 if args.quick else max(3, min(20, int(math.ceil(40 / max(work, 1e-3)))))
            for impl in IMPLS:
                rec = run_case(shape, T, impl, reps, env)
                records.append(rec)
                print(json.dumps({k_: v for k_, v in rec.items()
                                  if k_ not in ("gpu", "torch", "triton", "date")}), flush=True)
                out = Path(args.out)  # rewritten after every case: a time limit loses nothing
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(records, indent=1))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1))
    print(f"\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  -> {out}")
    print(f"{'shape':<16}{'T':>7} {'impl':<21}{'fwd ms':>9}{'bwd ms':>9}{'TFLOP/s':>9}"
          f"{'fwd TF/s':>9}{'peak GB':>9}  error")
    for r in records:
        if r["impl"].startswith("sweep:"):
            continue
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
        print(f"{r['shape']:<16}{r['T']:>7} {r['impl']:<21}{f(r['fwd_ms'], '9.2f')}"
              f"{f(r['bwd_ms'], '9.2f')}{f(r['tflops'], '9.0f')}{f(r.get('fwd_tflops'), '9.0f')}"
              f"{f(r['peak_bytes'] and r['peak_bytes'] / 1e9, '9.2f')}  {r.get('error', '')}")
    for shape in shapes:
        for T in tokens:
            pair = {r["impl"]: r for r in records if r["shape"] == shape and r["T"] == T}
            a, b = pair.get("permute_free"), pair.get("grouped_mm_baseline")
            if a and b and a["fwd_ms"] and b["fwd_ms"]:
                print(f"{shape} T={T}: fwd+bwd speedup "
                      f"{(b['fwd_ms'] + b['bwd_ms']) / (a['fwd_ms'] + a['bwd_ms']):.2f}x, "
                      f"peak memory {a['peak_bytes'] / b['peak_bytes']:.2f}x of baseline")


if __name__ == "__main__":
    main()
