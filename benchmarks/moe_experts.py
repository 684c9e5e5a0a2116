"""Expert-path benchmark on one GPU: permute_free (Triton) vs permute + torch._grouped_mm.

    python benchmarks/moe_experts.py [--shapes qwen3,mixtral,deepseek-v3-64e]
        [--tokens 1024,8192,32768] [--quick] [--check] [--sweep] [--out PATH]
    python benchmarks/moe_experts.py --variants [--tokens 1024,8192,32768]
        [--variant-names base,tma,...] [--out PATH]

Times forward and backward separately (CUDA events, median after warm-up), peak memory of one
forward+backward above the inputs' baseline, and TFLOP/s from useful FLOPs
(forward 2*N*H*2F + 2*N*F*H with N = T*k routes, backward twice that). Routing: random router
logits -> softmax -> top-k; weights ~ N(0, 0.02) in bf16. A case that fails (OOM, a missing
op) is recorded with its error and the run goes on. The last lines are a table; the records go
to --out as JSON. --sweep times a few tile configs of every GEMM at one shape and prints the
fastest; --check compares both impls with an fp32 reference on a small case first.

--variants (see `variants` below): at the Qwen3 shape, every slot-GEMM kernel of the forward
(FC1, FC2) and the dA / dX kernels under each GemmConfig variant (tma, persistent, ...) and a
few tile configs, each checked against the default path's output; then the whole permute-free
forward per variant. Writes its own JSON (--out, default results/moe_experts_variants.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from moegraph_cli.moe.experts import (build_routes, permute_free_moe,  # noqa: E402
                                      permute_free_moe_with_drops, tile_configs)
from moegraph_cli.moe.reference import reference_moe  # noqa: E402
from moegraph_kernels import gather_gemm  # noqa: E402
from moegraph_kernels.gather_gemm import (GemmConfig, dact_swiglu, dp_tiles,  # noqa: E402
                                          fc1_config, fc1_swiglu, slot_gemm, slot_gemm_config)
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


# ---------------------------------------------------------------------------------------------
# --variants: the slot-GEMM variants (GemmConfig tma / persistent / ...) at the Qwen3 shape.

VARIANT_FIELDS = {  # name: GemmConfig fields (see kernels/gather_gemm.py)
    "base": {},
    "tma": dict(tma=True),
    "persistent": dict(persistent=True),
    "tma+persistent": dict(tma=True, persistent=True),
    "tma+persistent+noflat": dict(tma=True, persistent=True, flatten=False),
    "tma+persistent+ws": dict(tma=True, persistent=True, warp_specialize=True),
}
# Alternative tiles (block_m, block_n, block_k, group_m, num_warps, num_stages), each tried
# under ALT_VARIANTS; every variant also runs the kernel's default tile.
ALT_TILES = {
    "fc1": [GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 4),
            GemmConfig(128, 64, 64, 8, 4, 4), GemmConfig(64, 128, 64, 8, 4, 4)],
    "fc2": [GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 256, 64, 8, 8, 4),
            GemmConfig(64, 128, 64, 8, 4, 4)],
    "dact": [GemmConfig(128, 64, 64, 8, 4, 4), GemmConfig(64, 128, 64, 8, 4, 4)],
    "dx": [GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 256, 64, 8, 8, 4)],
}
ALT_VARIANTS = ("base", "tma+persistent")
# Warp specialization (slot_gemm only): on Hopper 4 warps become 1 producer + 2 consumer warp
# groups splitting a 128-row tile; the gathered kernels ignore the flag.
WS_TILE = GemmConfig(128, 256, 64, 8, 4, 3)
WS_KERNELS = ("fc2", "dx")
VARIANT_KERNELS = ("fc1", "fc2", "dact", "dx")
SLEEP_CYCLES = 200_000  # ~0.1 ms of GPU work queued ahead of each timed launch


def kernel_flops(kernel, E, H, F_, k, T):
    n = T * k
    return {"fc1": 2 * n * H * 2 * F_, "fc2": 2 * n * F_ * H, "dact": 2 * n * H * F_,
            "dx": 2 * n * 2 * F_ * H}[kernel]


def time_events(fn, reps, warmup=2):
    """Median ms of one launch: CUDA events around each launch, with a sleep kernel queued
    first so the host's launch overhead (descriptors, arguments) stays off the measurement."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        torch.cuda._sleep(SLEEP_CYCLES)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        pairs.append((e0, e1))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


def capture_graph(fn):
    """fn captured in a CUDA graph after one warm-up call on a side stream, replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(fn, reps):
    """ms per call when one call is captured in a CUDA graph and replayed back to back."""
    graph = capture_graph(fn)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    del graph
    return e0.elapsed_time(e1) / reps


def random_routes(T, E, K, H, F, seed=0):
    """Top-k of random scores on the CPU (seeded), built into the RouteList at the default
    slot block on the GPU: what the sweeps run their kernels over."""
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(dev)
    weights = torch.rand(T, K, generator=g).to(dev)
    return build_routes(ids, weights, E, tile_configs(T * K, E, H, F, dev).route_block, None)


def copy_bandwidth_gbs(nbytes=2 ** 30):
    """Device-to-device copy bandwidth, GB/s of traffic (read + write), back-to-back."""
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_throughput(lambda: dst.copy_(src), 20, 3) / 1e6


def time_throughput(fn, reps, warmup=2):
    """ms per call of `reps` calls back to back between one pair of events (host overhead
    overlaps GPU work, as in training)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


def _error(exc):
    lines = str(exc).strip().splitlines()
    # MLIR failures put the useful line after a long IR dump: keep the first and any 'error:'.
    picked = [ln for ln in lines if "error" in ln.lower()][:2] or lines[:1]
    return f"{type(exc).__name__}: {' | '.join(x.strip()[:200] for x in picked)}"


def _compare(got, want, live):
    """(max |diff| over live rows, bitwise equal) of lists of outputs."""
    diff, equal = 0.0, True
    for g, w in zip(got, want):
        g, w = g[live], w[live]
        if not torch.isfinite(g).all():
            return math.inf, False
        diff = max(diff, (g.float() - w.float()).abs().max().item() if g.numel() else 0.0)
        equal = equal and torch.equal(g, w)
    return diff, equal


def _candidates(kernel, default_cfg, route_block, names):
    seen, out = set(), []

    def add(variant, tile):
        if variant not in names or tile.block_m > route_block:
            return
        if smem_bytes(tile, 2 if kernel == "fc1" else 1) > 220 * 1024:
            return
        cfg = tile._replace(**VARIANT_FIELDS[variant])
        if cfg not in seen:
            seen.add(cfg)
            out.append((variant, cfg, tile == default_cfg))

    for variant in names:
        if variant == "tma+persistent+ws":
            if kernel in WS_KERNELS:
                add(variant, WS_TILE)
        else:
            add(variant, default_cfg)
    for tile in ALT_TILES[kernel]:
        for variant in ALT_VARIANTS:
            add(variant, tile)
    return out


def variants(tokens, names, env, out=None, deadline_s=200.0, device="cuda"):
    """Per-kernel and whole-forward timings of the slot-GEMM variants at the Qwen3 shape.
    Past `deadline_s` only the default tiles run. The records so far are rewritten to `out`
    after every kernel, so a crash or a time limit loses little. (`device` exists for a CPU
    smoke run.)"""
    start = time.monotonic()
    records = []

    def save():
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(records, indent=1))

    gather_gemm.FALLBACK_ON_ERROR = False  # a failing variant is an error here, not a fallback
    for T in tokens:
        alive = _variants_at(T, names, env, records, start + deadline_s, torch.device(device),
                             save)
        torch.cuda.empty_cache()
        if not alive:
            break
    print(f"variants: {time.monotonic() - start:.0f} s")
    return records


def _variants_at(T, names, env, records, deadline, dev, save):
    """One token count: every kernel's candidates, then the whole forward per variant. Appends
    to `records`; False when the CUDA context was lost."""
    E, H, F_, k = SHAPES["qwen3"]
    nan = math.nan
    x, ids, w, wgu, wd, dout = make_case(E, H, F_, k, T)
    x, w, wgu, wd = (t.detach() for t in (x, w, wgu, wd))
    base_cfgs = tile_configs(T * k, E, H, F_, dev)
    block = base_cfgs.route_block
    routes = build_routes(ids, w, E, block, None)
    S, w_N = routes.num_slots, w.reshape(-1)
    live = (routes.block_expert >= 0).repeat_interleave(block)
    bf = x.dtype
    y1, act = torch.empty(S, 2 * F_, device=dev, dtype=bf), torch.empty(S, F_, device=dev,
                                                                      dtype=bf)
    fc1_swiglu(x, wgu, w_N, routes, y1, act, base_cfgs.fc1)
    dy1 = torch.empty_like(y1)
    dact_swiglu(dout, wd, y1, w_N, routes, dy1, torch.empty_like(act),
                torch.empty(S, dp_tiles(F_, base_cfgs.dact), device=dev), base_cfgs.dact)
    outs = {"fc1": [torch.empty_like(y1), torch.empty_like(act)],
            "fc2": [torch.empty(S, H, device=dev, dtype=bf)],
            "dact": [torch.empty_like(y1), torch.empty_like(act)],
            "dx": [torch.empty(S, H, device=dev, dtype=bf)]}
    dp_bufs = {}

    def launcher(kernel, cfg):
        o = outs[kernel]
        if kernel == "fc1":
            return lambda: fc1_swiglu(x, wgu, w_N, routes, o[0], o[1], cfg)
        if kernel == "fc2":
            return lambda: slot_gemm(act, wd, routes, o[0], w_nk=True, cfg=cfg)
        if kernel == "dx":
            return lambda: slot_gemm(dy1, wgu, routes, o[0], w_nk=False, cfg=cfg)
        tiles = dp_tiles(F_, cfg)
        if tiles not in dp_bufs:
            dp_bufs[tiles] = torch.empty(S, tiles, device=dev)
        dp = dp_bufs[tiles]
        return lambda: dact_swiglu(dout, wd, y1, w_N, routes, o[0], o[1], dp, cfg)

    def written(kernel, cfg):
        return outs[kernel] + ([dp_bufs[dp_tiles(F_, cfg)]] if kernel == "dact" else [])

    def snapshot(kernel, cfg):
        got = list(outs[kernel])
        if kernel == "dact":  # dp's columns follow block_n: compare its row sums
            got.append(dp_bufs[dp_tiles(F_, cfg)].sum(dim=1))
        return got

    default = {"fc1": base_cfgs.fc1, "fc2": base_cfgs.fc2, "dact": base_cfgs.dact,
               "dx": base_cfgs.dx}
    reference, best, kernel_ms = {}, {}, {}
    reps = 20 if T <= 8192 else 10
    for kernel in VARIANT_KERNELS:
        flops = kernel_flops(kernel, E, H, F_, k, T)
        for variant, cfg, is_default in _candidates(kernel, default[kernel], block, names):
            rec = dict(mode="variants", shape="qwen3", T=T, kernel=kernel, variant=variant,
                       config=list(cfg)[:6], default_tile=is_default, route_block=block,
                       **env)
            if not is_default and time.monotonic() > deadline:
                rec["error"] = "skipped: past the time budget"
                records.append(rec)
                continue
            try:
                fn = launcher(kernel, cfg)
                for t in written(kernel, cfg):  # a row left unwritten shows up as NaN
                    t.fill_(nan)
                fn()
                torch.cuda.synchronize()
                plan = gather_gemm.LAST_PLAN[kernel]
                rec["ran"] = plan._asdict()
                got = snapshot(kernel, cfg)
                if kernel not in reference:  # the first candidate is the default path
                    assert variant == "base" and is_default, (variant, cfg)
                    reference[kernel] = [t.clone() for t in got]
                diff, equal = _compare(got, reference[kernel], live)
                scale = max(t[live].float().abs().max().item() for t in reference[kernel])
                ms = time_events(fn, reps)
                rec.update(kernel_ms=ms, tflops=flops / ms / 1e9, max_abs_diff=diff,
                           bitwise=equal, ok=diff <= 1e-2 * max(scale, 1.0))
                if T <= 1024:
                    try:
                        rec["graph_ms"] = time_graph(fn, 50)
                        rec["graph_tflops"] = flops / rec["graph_ms"] / 1e9
                    except Exception as exc:  # capture failed: keep the eager timing
                        rec["graph_error"] = _error(exc)
                kernel_ms[kernel, cfg] = ms
                if rec["ok"] and (kernel not in best or ms < best[kernel][0]):
                    best[kernel] = (ms, cfg, variant)
            except Exception as exc:  # compile failure, out of resources, ...: record it
                rec["error"] = _error(exc)
                try:
                    torch.cuda.synchronize()
                except Exception as ctx_exc:  # the CUDA context is gone: stop here
                    rec["error"] += f" (CUDA context lost: {_error(ctx_exc)})"
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
                    save()
                    return False
            records.append(rec)
            _print_variant_line(rec)
        save()

    # The whole permute-free forward (routing, FC1, FC2, combine) per variant.
    fflops = fwd_flops(E, H, F_, k, T)
    fwd_ref = None
    plans = [(name, VARIANT_FIELDS[name]) for name in names]
    if "fc1" in best and "fc2" in best:
        plans.append(("best", None))
    if block < 128:  # few routes per expert: would 128-row blocks (one per expert) read less?
        plans += [(f"rb128:{name}", VARIANT_FIELDS[name]) for name in ("base", "tma+persistent")
                  if name in names]
    for name, fields in plans:
        rec = dict(mode="variants_forward", shape="qwen3", T=T, variant=name, **env)
        if name.startswith("rb128:"):
            cfgs = base_cfgs._replace(route_block=128, fc1=fc1_config(F_, 128, dev),
                                      fc2=slot_gemm_config(H, 128, dev))
            cfgs = cfgs._replace(fc1=cfgs.fc1._replace(**fields), fc2=cfgs.fc2._replace(**fields))
        elif fields is None:
            cfgs = base_cfgs._replace(fc1=best["fc1"][1], fc2=best["fc2"][1])
        elif name == "tma+persistent+ws":  # FC1 gathers: it has no warp-specialized form
            cfgs = base_cfgs._replace(
                fc1=base_cfgs.fc1._replace(**VARIANT_FIELDS["tma+persistent"]),
                fc2=(WS_TILE if block >= 128 else base_cfgs.fc2)._replace(**fields))
        else:
            cfgs = base_cfgs._replace(fc1=base_cfgs.fc1._replace(**fields),
                                      fc2=base_cfgs.fc2._replace(**fields))
        rec.update(fc1=list(cfgs.fc1), fc2=list(cfgs.fc2))
        try:
            def fwd(cfgs=cfgs):
                return permute_free_moe_with_drops(x, ids, w, wgu, wd, None, cfgs)[0]

            with torch.no_grad():
                y = fwd()
                if fwd_ref is None:
                    fwd_ref = y.clone()
                diff, equal = _compare([y], [fwd_ref], slice(None))
                ms = time_throughput(fwd, reps)
                rec.update(fwd_ms=ms, fwd_tflops=fflops / ms / 1e9, max_abs_diff=diff,
                           bitwise=equal)
                if T <= 1024:
                    try:
                        rec["graph_fwd_ms"] = time_graph(fwd, 20)
                        rec["graph_fwd_tflops"] = fflops / rec["graph_fwd_ms"] / 1e9
                    except Exception as exc:
                        rec["graph_error"] = _error(exc)
                pair = [kernel_ms.get(("fc1", cfgs.fc1)), kernel_ms.get(("fc2", cfgs.fc2))]
                if None not in pair:
                    rec["fc1_fc2_ms"] = sum(pair)
                    rec["fc1_fc2_tflops"] = fflops / sum(pair) / 1e9
        except Exception as exc:
            rec["error"] = _error(exc)
        records.append(rec)
        print(json.dumps({k_: v for k_, v in rec.items() if k_ not in env}), flush=True)
    save()
    return True


def _print_variant_line(rec):
    head = (f"{rec['T']:>6} {rec['kernel']:>4} {rec['variant']:<22} "
            f"{str(tuple(rec['config'])):<28}")
    if "error" in rec:
        print(head + " " + rec["error"], flush=True)
        return
    ran = rec["ran"]
    ran_s = ("tma " if ran["tma"] else "") + ("persistent " if ran["persistent"] else "") + (
        "ws " if ran["warp_specialize"] else "") + ("" if ran["flatten"] or not ran["persistent"]
                                                    else "noflat")
    print(head + f" {rec['kernel_ms']:8.3f} ms {rec['tflops']:6.0f} TF/s"
          + (f"  graph {rec['graph_ms']:.3f} ms" if "graph_ms" in rec else "")
          + f"  diff {rec['max_abs_diff']:.1e}{' bitwise' if rec['bitwise'] else ''}"
          + f"  ran: {ran_s.strip() or 'pointer'}", flush=True)


def print_variant_tables(records, names):
    rows = [r for r in records if r.get("mode") == "variants"]
    if not rows:
        return
    print("\nPer-kernel TFLOP/s, best tile of each variant (* = not the default tile; "
          "! = output off the default path; x = failed; graph = CUDA-graph replay)")
    print(f"{'T':>6} {'kernel':<6}" + "".join(f"{n:>23}" for n in names))
    for T in sorted({r["T"] for r in rows}):
        for kernel in VARIANT_KERNELS:
            cells = []
            for name in names:
                mine = [r for r in rows if r["T"] == T and r["kernel"] == kernel and
                        r["variant"] == name]
                good = [r for r in mine if "tflops" in r]
                if not good:
                    cells.append("x" if any("error" in r and not r["error"].startswith("skip")
                                            for r in mine) else "-")
                    continue
                r = max(good, key=lambda r: r["tflops"])
                cell = f"{r['tflops']:.0f}" + ("" if r["default_tile"] else "*") + (
                    "" if r["ok"] else "!")
                if "graph_tflops" in r:
                    cell += f" (graph {r['graph_tflops']:.0f})"
                cells.append(cell)
            print(f"{T:>6} {kernel:<6}" + "".join(f"{c:>23}" for c in cells))
    fwd = [r for r in records if r.get("mode") == "variants_forward"]
    if fwd:
        print("\nWhole forward (routing + FC1 + FC2 + combine), TFLOP/s: events over back-to-back "
              "calls; graph = replay; FC1+FC2 = from the kernel times alone")
        print(f"{'T':>6} {'variant':<22}{'fwd ms':>9}{'TF/s':>7}{'graph TF/s':>12}"
              f"{'FC1+FC2 TF/s':>14}{'max|diff|':>11}  error")
        for r in fwd:
            def f(key, fmt):
                width = int(fmt.split(".")[0])
                return format(r[key], fmt) if key in r else "-".rjust(width)
            print(f"{r['T']:>6} {r['variant']:<22}{f('fwd_ms', '9.3f')}{f('fwd_tflops', '7.0f')}"
                  f"{f('graph_fwd_tflops', '12.0f')}{f('fc1_fc2_tflops', '14.0f')}"
                  f"{f('max_abs_diff', '11.1e')}  {r.get('error', '')}")
    print("\nFastest correct config per kernel:")
    for T in sorted({r["T"] for r in rows}):
        for kernel in VARIANT_KERNELS:
            good = [r for r in rows if r["T"] == T and r["kernel"] == kernel and r.get("ok")]
            if good:
                r = min(good, key=lambda r: r["kernel_ms"])
                base = [b for b in good if b["variant"] == "base" and b["default_tile"]]
                speed = f"{base[0]['kernel_ms'] / r['kernel_ms']:.2f}x vs default" if base else ""
                print(f"  T={T:<6} {kernel:<5} {r['variant']:<22} {tuple(r['config'])} "
                      f"{r['kernel_ms']:.3f} ms {r['tflops']:.0f} TF/s  {speed}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--quick", action="store_true", help="qwen3 only, T=1024,8192, fewer reps")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="tile-config sweep at --sweep-shape")
    ap.add_argument("--sweep-shape", default="qwen3:8192")
    ap.add_argument("--variants", action="store_true",
                    help="time the slot-GEMM variants (tma, persistent, ...) at the Qwen3 shape")
    ap.add_argument("--variant-names", default=",".join(VARIANT_FIELDS),
                    help="variants to run with --variants (base is always run first)")
    ap.add_argument("--out", default=None, help="JSON records (default results/moe_experts.json, "
                    "or results/moe_experts_variants.json with --variants)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_experts: needs a CUDA GPU")
    results = Path(__file__).parent / "results"
    args.out = args.out or str(results / ("moe_experts_variants.json" if args.variants
                                          else "moe_experts.json"))

    now = datetime.datetime.now().isoformat(timespec="seconds")
    env = dict(gpu=torch.cuda.get_device_name(), torch=str(torch.__version__),
               triton=triton.__version__, date=now)
    if args.variants:
        names = ["base"] + [n for n in args.variant_names.split(",") if n and n != "base"]
        unknown = [n for n in names if n not in VARIANT_FIELDS]
        if unknown:
            sys.exit(f"moe_experts: unknown variant {unknown[0]}; "
                     f"known: {', '.join(VARIANT_FIELDS)}")
        out = Path(args.out)
        records = variants([int(t) for t in args.tokens.split(",")], names, env, out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1))
        print(f"\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  -> {out}")
        print_variant_tables(records, names)
        return
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
