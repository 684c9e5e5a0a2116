"""Each expert kernel alone under candidate tile configs and variants, Qwen3 expert shape.

    python3 benchmarks/kernel_sweep.py [--tokens 1024,8192,32768] [--routing uniform,skewed]
        [--kernels fc1,fc2,dact,dx,wgrad_down,wgrad_gate_up] [--candidates NAME,...]
        [--rounds 7] [--sequential] [--out PATH]

Per (T, routing): the inputs of one layer (E = 128, k = 8, H = 2048, F = 768, bf16, weights
N(0, 0.02), routing as benchmarks/experts.py draws it), the RouteList at the product's slot
block, and the product's own FC1 and dA outputs (Y1, A, dY1) as every later kernel's inputs.
Then per kernel and candidate: 10 launches into preallocated outputs captured in one CUDA
graph; after about 1 s of the default's replays (the power cap sets the clock), `--rounds`
rounds in which each candidate's graph replays back to back for about 40 ms in turn, each
burst after as long a burst of the default's (untimed: every candidate then starts from the
clock the same predecessor leaves), the order shuffled a round (common.round_orders); the
median ms per launch, the SM clock it ran at (`sm_mhz`, NVML) and TFLOP/s of useful FLOPs (no
padding rows). `--sequential`: the method of the results before this one, each candidate timed as it
comes, one 10-launch replay a round, in bursts short enough to run at a clock the power cap
has not yet lowered; whether two runs are bitwise equal on the rows it writes (`deterministic`)
and whether the output equals the product default's (`equal_default`, with the max |diff|
otherwise). The first candidate of each kernel is the product's default (`default: true`);
the second, `twin`, is the same config again, its own graph and outputs: how far it lands from the
default is the resolution of the run (`twin_ratio` on the default's record). A
plain torch.mm of [T k, H] x [H, 2F] gives the dense bf16 ceiling on the same FLOPs
(`dense_mm`). The kernels' fallback is off, so a variant that fails is an error, not a slower
figure. Two candidates are not product paths: torch's `_grouped_mm` dW, and `presorted`
(the gathered operand copied to slot order first; `all_candidates`).

Writes kernel_sweep.json (--out; default $OUT/kernel_sweep.json).
"""

from __future__ import annotations

import argparse
import statistics

from common import default_out, environment, error_text, write_json
from experts import make_routing

E, H, F, K = 128, 2048, 768, 8
DEVICE = "cuda"  # tests of this script run it on the CPU (interpreter) at small sizes


def candidates(kernel: str, block: int, defaults) -> list[tuple[str, object, bool]]:
    """(name, GemmConfig, padded) per candidate; the product's default first."""
    from moegraph_kernels.gemm_config import GemmConfig as G
    d = getattr(defaults, kernel)
    out = [("default", d, True), ("twin", d, True)]
    if kernel in ("fc1", "dact") and d.fast_act:
        # Triton's own fp32 exp and division in the gated activation (gated_act.py, FAST off)
        out.append(("exact", d._replace(fast_act=False), True))
    if kernel.startswith("wgrad"):
        out.append(("masked", d._replace(tma=False), False))
        long = [G(128, 128, 32, 8, 8, 5), G(128, 128, 64, 4, 8, 3), G(128, 128, 64, 4, 8, 4),
                G(128, 128, 64, 4, 8, 5), G(128, 128, 64, 4, 8, 6), G(128, 256, 64, 4, 8, 3),
                G(128, 256, 64, 4, 8, 4), G(256, 128, 64, 4, 8, 3),
                # 4 warps, 2 or 3 stages: two CTAs an SM, one's epilogue under the other's loop
                G(128, 128, 64, 8, 4, 2), G(128, 128, 64, 8, 4, 3), G(128, 128, 64, 4, 4, 3),
                # 8 warps capped at 128 registers: two CTAs an SM at 2 or 3 stages
                G(128, 128, 64, 8, 8, 2, maxnreg=128), G(128, 128, 64, 8, 8, 3, maxnreg=128)]
        short = [G(128, 128, 32, 8, 4, 2), G(128, 128, 64, 8, 4, 2), G(128, 128, 64, 8, 4, 3),
                 G(128, 128, 64, 8, 8, 3)]
        for t in (short if block < 128 else long):
            cap = "" if t.maxnreg is None else f"+r{t.maxnreg}"
            out += [(f"{'x'.join(map(str, t[:6]))}{cap}", t, True),
                    (f"{'x'.join(map(str, t[:6]))}+tma{cap}", t._replace(tma=True), True)]
        # The default tile neither persistent (one program an SM) nor written by a TMA store,
        # either, and both.
        plain = d._replace(persistent=False, store_tma=False, warp_specialize=False)
        out += [("plain", plain, True)] if plain != d else []
        # The warp-specialized Gluon kernel (kernels/wgrad_ws.py) at the default's tile, at 2
        # stages and at tile groups of 8 (each once: the default may be one of them).
        ws = d._replace(persistent=True, warp_specialize=True)
        for name, c in (("ws", ws), ("ws_s2", ws._replace(num_stages=2)),
                        ("ws_g8", ws._replace(group_m=8))):
            out += [(name, c, True)] if c not in [o[1] for o in out] else []
        out += [("persistent", plain._replace(persistent=True), True),
                ("tmastore", plain._replace(store_tma=True), True),
                ("persistent+tmastore", plain._replace(persistent=True, store_tma=True), True)]
        # Not a product path: the gathered operand copied to slot order, then torch's
        # K-grouped _grouped_mm over the padded segments (the copy is timed with it).
        out.append(("grouped_mm", d._replace(tma=False), False))
        return out
    if kernel == "fc1" and d.warp_specialize:
        # The Triton kernel at the same tile, against the Gluon one (kernels/fc1_swiglu_ws.py),
        # which also runs asked for 3 stages (what fits beside its hand-off buffers either way)
        # and at tile groups of 8.
        out += [("triton", d._replace(warp_specialize=False), True),
                ("ws_s3", d._replace(num_stages=3), True),
                ("ws_g8", d._replace(group_m=8), True)]
    if kernel in ("fc2", "dx") and d.persistent:
        # The persistent Triton kernel (no Gluon), and the warp-specialized Gluon kernel
        # (kernels/slot_gemm_ws.py) at 2 stages and at tile groups of 4 (each once).
        ws = d._replace(warp_specialize=True)
        for name, c in (("triton", d._replace(warp_specialize=False)), ("ws", ws),
                        ("ws_s2", ws._replace(num_stages=2)), ("ws_g4", ws._replace(group_m=4))):
            out += [(name, c, True)] if c not in [o[1] for o in out] else []
    if kernel == "dact":
        # Persistent dA spilled before its epilogue masked rows by the route (3-20x slower,
        # kernel_sweep_8192.json); the 4-warp tiles fit two CTAs an SM.
        warps = 8 if block >= 128 else 4
        tiles = [d, G(block, 128, 64, 8, warps, 3), G(block, 128, 64, 8, warps, 5),
                 G(block, 128, 32, 8, warps, 5), G(block, 64, 64, 8, 4, 4),
                 G(block // 2, 128, 64, 8, 4, 4)]
        variants = ("base", "tma", "tma+persistent")
        # 8 warps capped at 128 registers, 2 or 3 stages (64 or 96 KB): two CTAs an SM, so
        # one's epilogue (two Y1 tiles read, three written) runs under the other's K loop
        for stages in (2, 3):
            c = G(block, 128, 64, 8, 8, stages, maxnreg=128)
            out += [(f"{'x'.join(map(str, c[:6]))}+{v}", c.with_variant(v), True)
                    for v in ("r128", "tma+r128")]
    elif kernel == "dx":
        tiles = [d, d._replace(num_stages=4)]
        variants = ("base", "tma", "tma+persistent")
    else:
        return out
    for t in tiles:
        for v in variants:
            c = t.with_variant(v)
            if c != d and c not in [o[1] for o in out[2:]]:
                out.append((f"{'x'.join(map(str, c[:6]))}+{v}", c, True))
    return out


# The kernels with a gathered operand, and which: X (fc1, dW_gate_up) or dOut (dA, dW_down).
GATHERED = {"fc1": "x", "wgrad_gate_up": "x", "dact": "dout", "wgrad_down": "dout"}


def all_candidates(kernel: str, block: int, defaults) -> list[tuple[str, object, bool]]:
    """`candidates`, then for the kernels with a gathered operand two that are not product
    paths: that operand first copied to slot order (a zero row for padding), then the default
    tile reading it in slot order (`presorted`, the copy timed with it; `presorted_nocopy` the
    kernel alone): a dW then loads both operands by TMA, FC1 and dA read contiguous rows
    through the same pointer loads."""
    out = candidates(kernel, block, defaults)
    if kernel in GATHERED:
        d = getattr(defaults, kernel)
        out += [("presorted", d, True), ("presorted_nocopy", d, True)]
    return out


def slot_order(rows, routes):
    """(copy(), rows_S, routes'): copy() writes rows_S [S, C] = rows[slot_token] (zeros for
    padding slots); routes' maps each slot to its own row (padding to the sentinel S)."""
    import torch
    S = routes.num_slots
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    tok = routes.slot_token.long().clamp(max=rows.shape[0])
    rows_S = rows.new_empty(S, rows.shape[1])
    ident = torch.where(routes.slot_token < rows.shape[0],
                        torch.arange(S, device=rows.device, dtype=routes.slot_token.dtype),
                        torch.full_like(routes.slot_token, S))
    return lambda: torch.index_select(padded, 0, tok, out=rows_S), rows_S, \
        routes._replace(slot_token=ident)


def flops(kernel: str, routes_n: int) -> int:
    return {"fc1": 2 * 2 * F * H, "fc2": 2 * F * H, "dact": 2 * F * H, "dx": 2 * 2 * F * H,
            "wgrad_down": 2 * F * H, "wgrad_gate_up": 2 * 2 * F * H}[kernel] * routes_n


def graph_ms(fn, rounds: int, launches: int = 10) -> float:
    """Median ms a launch of `launches` launches captured in one graph, each round one replay
    (the method of `--sequential`)."""
    import torch
    from common import capture_graph
    if DEVICE == "cpu":
        fn()
        return float("nan")
    graph = capture_graph(lambda: [fn() for _ in range(launches)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / launches)
    return statistics.median(times)


def interleaved_graph_ms(fns: dict, rounds: int, launches: int = 10, burst_ms: float = 40.0,
                         heat_ms: float = 1000.0) -> dict:
    """{name: {"ms": per launch, "sm_mhz"}} for each fn: `launches` launches captured in one
    graph, then, after about `heat_ms` of the first fn's replays (so that the power cap has
    set the clock), `rounds` rounds in which every graph replays back to back for about
    `burst_ms` in turn, each burst led by as long a burst of the first fn's (untimed), the
    order shuffled a round (common.interleaved_ms)."""
    import time

    import torch
    from common import capture_graph, interleaved_ms
    if DEVICE == "cpu":
        for fn in fns.values():
            fn()
        return {n: {"ms": float("nan"), "sm_mhz": None} for n in fns}
    graphs = {n: capture_graph(lambda fn=fn: [fn() for _ in range(launches)])
              for n, fn in fns.items()}
    first = next(iter(graphs.values()))
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < heat_ms:
        first.replay()
        torch.cuda.synchronize()
    replay_ms = max(graph_ms(fn, 1, launches) for fn in fns.values()) * launches
    reps = max(1, round(burst_ms / max(replay_ms, 1e-3)))
    timed = interleaved_ms({n: g.replay for n, g in graphs.items()}, reps, rounds, warmup=1,
                           lead=first.replay)
    return {n: {"ms": t["ms"] / launches, "sm_mhz": t["sm_mhz"]} for n, t in timed.items()}


def setup(T: int, routing: str, skew: float):
    import torch
    from moegraph_cli.moe.experts import build_routes, tile_configs
    from moegraph_kernels.dact_swiglu import dact_swiglu, dp_tiles
    from moegraph_kernels.fc1_swiglu import fc1_swiglu
    dev = torch.device(DEVICE)
    bf = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(T)
    ids, w = make_routing(T, E, K, routing, skew, seed=0)
    x = torch.randn(T, H, device=dev, generator=gen).to(bf)
    w_gu = (torch.randn(E, 2 * F, H, device=dev, generator=gen) * 0.02).to(bf)
    w_down = (torch.randn(E, H, F, device=dev, generator=gen) * 0.02).to(bf)
    dout = torch.randn(T, H, device=dev, generator=gen).to(bf)
    w_N = w.to(dev, bf).reshape(-1).contiguous()
    cfg = tile_configs(T * K, E, H, F, dev)
    routes = build_routes(ids.to(dev), w.to(dev, bf), E, cfg.route_block, None)
    S = routes.num_slots
    y1, act = torch.empty(S, 2 * F, device=dev, dtype=bf), torch.empty(S, F, device=dev, dtype=bf)
    fc1_swiglu(x, w_gu, w_N, routes, y1, act, cfg.fc1)
    dy1, act2 = torch.empty_like(y1), torch.empty_like(act)
    dact_swiglu(dout, w_down, y1, w_N, routes, dy1, act2,
                torch.empty(S, dp_tiles(F, cfg.dact), device=dev, dtype=torch.float32), cfg.dact)
    return dict(x=x, w_gu=w_gu, w_down=w_down, dout=dout, w_N=w_N, routes=routes, y1=y1,
                act=act, dy1=dy1), cfg


def runner(kernel: str, name: str, cfg, padded: bool, t: dict):
    """(launch, outputs): launch() runs the kernel once into the outputs."""
    import torch
    import moegraph_kernels.wgrad as wg
    from moegraph_kernels.dact_swiglu import dact_swiglu, dp_tiles
    from moegraph_kernels.fc1_swiglu import fc1_swiglu
    from moegraph_kernels.slot_gemm import slot_gemm
    r, S = t["routes"], t["routes"].num_slots
    bf = t["x"].dtype
    new = lambda *shape, dt=bf: torch.empty(shape, device=DEVICE, dtype=dt)  # noqa
    if name.startswith("presorted"):
        copy, rows_S, r_S = slot_order(t[GATHERED[kernel]], r)
        copy()
        t = {**t, "routes": r_S, "presorted": rows_S}
        inner, outs = runner(kernel, "default", cfg, padded, t)
        if name == "presorted_nocopy":
            return inner, outs
        return lambda: (copy(), inner()), outs
    if kernel.startswith("wgrad"):
        down = kernel == "wgrad_down"
        out = new(E, H, F) if down else new(E, 2 * F, H)
        l_rows, r_rows = (t["dout"], t["act"]) if down else (t["dy1"], t["x"])
        gather = (down, not down)
        if "presorted" in t:  # both operands in slot order
            l_rows, r_rows = (t["presorted"], t["act"]) if down else (t["dy1"], t["presorted"])
            gather = (False, False)

        if name == "grouped_mm":
            return grouped_mm_wgrad(l_rows, r_rows, r, out, down), [out]

        def launch():
            wg.PADDED_K = padded
            wg.expert_wgrad(l_rows, r_rows, r, out, *gather, cfg)
        return launch, [out]
    if kernel == "fc1":
        outs = [new(S, 2 * F), new(S, F)]
        x = t.get("presorted", t["x"])
        return lambda: fc1_swiglu(x, t["w_gu"], t["w_N"], r, *outs, cfg), outs
    if kernel == "fc2":
        outs = [new(S, H)]
        return lambda: slot_gemm(t["act"], t["w_down"], r, outs[0], True, cfg), outs
    if kernel == "dact":
        outs = [new(S, 2 * F), new(S, F), new(S, dp_tiles(F, cfg), dt=torch.float32)]
        dout = t.get("presorted", t["dout"])
        return lambda: dact_swiglu(dout, t["w_down"], t["y1"], t["w_N"], r, *outs,
                                   cfg), outs
    outs = [new(S, H)]
    return lambda: slot_gemm(t["dy1"], t["w_gu"], r, outs[0], False, cfg), outs


def grouped_mm_wgrad(l_rows, r_rows, routes, out, gather_l: bool):
    """launch() for dW by torch._grouped_mm: out[e] = L[seg e]^T R[seg e] over the padded
    segments, the gathered operand first copied to slot order (a zero row for padding)."""
    import torch
    counts = routes.expert_counts.long()
    ends = (routes.expert_starts.long() + (counts + routes.block_m - 1) // routes.block_m
            * routes.block_m).to(torch.int32)
    gathered = l_rows if gather_l else r_rows
    padded = torch.cat([gathered, gathered.new_zeros(1, gathered.shape[1])])
    tok = routes.slot_token.long().clamp(max=gathered.shape[0])

    def launch():
        rows = padded.index_select(0, tok)
        a, b = (rows, r_rows) if gather_l else (l_rows, rows)
        out.copy_(torch._grouped_mm(a.t(), b, offs=ends))
    return launch


def dense_mm(T: int, dtype):
    """launch() of the dense ceiling: torch.mm of [T k, H] x [H, 2F] (FC1's or dX's FLOPs)."""
    import torch
    a = torch.randn(T * K, H, device=DEVICE).to(dtype)
    b = torch.randn(H, 2 * F, device=DEVICE).to(dtype)
    return lambda: torch.mm(a, b)


def live_rows(routes):
    return (routes.block_expert >= 0).repeat_interleave(routes.block_m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--skew", type=float, default=0.25)
    ap.add_argument("--kernels", default="fc1,fc2,dact,dx,wgrad_down,wgrad_gate_up")
    ap.add_argument("--candidates", default="",
                    help="comma list of candidate names to run (default: all)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sequential", action="store_true",
                    help="time each candidate as it comes, one replay a round (the method "
                         "before interleaved rounds)")
    ap.add_argument("--out", default=str(default_out("kernel_sweep.json")))
    args = ap.parse_args()
    import torch
    import moegraph_kernels.gemm_launch as gl
    import moegraph_kernels.wgrad as wg
    gl.FALLBACK_ON_ERROR = False
    padded_default = wg.PADDED_K
    only = set(filter(None, args.candidates.split(",")))
    doc = {**environment(DEVICE == "cuda"), "shape": dict(E=E, H=H, F=F, k=K), "records": []}
    for T in map(int, args.tokens.split(",")):
        for routing in args.routing.split(","):
            t, defaults = setup(T, routing, args.skew)
            live = live_rows(t["routes"])
            n = T * K
            mm = dense_mm(T, t["x"].dtype)
            dense = graph_ms(mm, args.rounds) if args.sequential else \
                interleaved_graph_ms({"dense_mm": mm}, args.rounds)["dense_mm"]["ms"]
            doc["records"].append(dict(T=T, routing=routing, kernel="dense_mm", ms=dense,
                                       tflops=2 * n * H * 2 * F / dense / 1e9))
            del mm  # its closure holds the dense operands
            for kernel in args.kernels.split(","):
                want, pending = None, {}
                for name, cfg, padded in all_candidates(kernel, defaults.route_block,
                                                        defaults):
                    if only and name not in only and name not in ("default", "twin"):
                        continue
                    padded = padded and padded_default
                    rec = dict(T=T, routing=routing, kernel=kernel, candidate=name,
                               config=list(cfg[:6]), variant=cfg.variant, padded=padded,
                               default=name == "default")
                    try:
                        launch, outs = runner(kernel, name, cfg, padded, t)
                        launch()
                        first = [o.clone() for o in outs]
                        launch()
                        if DEVICE == "cuda":
                            torch.cuda.synchronize()
                        # Slot outputs: the live rows (dead blocks are never written).
                        view = (lambda o: o) if kernel.startswith("wgrad") else \
                            (lambda o: o[live])
                        rec["deterministic"] = all(torch.equal(view(x), view(y)) for x, y in
                                                   zip(first, outs))
                        if want is None:
                            want = [view(o).clone() for o in outs]
                        # dA's dp partial sums have one column per N tile: compared only
                        # where the candidate's N tile is the default's.
                        pairs = [(view(o), w) for o, w in zip(outs, want)
                                 if view(o).shape == w.shape]
                        rec["equal_default"] = all(torch.equal(o, w) for o, w in pairs)
                        rec["max_abs_diff"] = max((o.float() - w).abs().max().item()
                                                  for o, w in pairs)
                        if args.sequential:
                            rec["ms"] = graph_ms(launch, args.rounds)
                        else:
                            pending[name] = launch
                        plan = gl.LAST_PLAN.get(kernel) if not kernel.startswith("wgrad") \
                            else (wg.LAST_WGRAD_PLAN.get(kernel == "wgrad_down"),
                                  wg.LAST_WGRAD_STORE.get(kernel == "wgrad_down"))
                        rec["ran"] = str(plan)
                    except Exception as exc:  # recorded; the sweep goes on
                        rec["error"] = error_text(exc)
                    wg.PADDED_K = padded_default
                    doc["records"].append(rec)
                try:
                    timed = interleaved_graph_ms(pending, args.rounds) if pending else {}
                except Exception as exc:  # noqa: BLE001 - a capture that fails: say which kernel
                    timed = {name: {"error": error_text(exc)} for name in pending}
                wg.PADDED_K = padded_default
                mine = [r for r in doc["records"] if r.get("kernel") == kernel
                        and r["T"] == T and r["routing"] == routing]
                ms = {r["candidate"]: timed.get(r["candidate"], r).get("ms") for r in mine}
                if ms.get("default") and ms.get("twin"):
                    mine[0]["twin_ratio"] = ms["twin"] / ms["default"]
                for rec in mine:
                    if rec["candidate"] in timed:
                        rec.update(timed[rec["candidate"]])
                    if "ms" in rec:
                        rec["tflops"] = flops(kernel, n) / rec["ms"] / 1e9
                    print(f"T={T:6d} {routing:8s} {kernel:14s} {rec['candidate']:34s} "
                          f"{rec.get('ms', float('nan')):7.3f} ms "
                          f"{rec.get('tflops', float('nan')):6.1f} TF/s "
                          f"eq={rec.get('equal_default')} det={rec.get('deterministic')} "
                          f"{rec.get('error', '')}", flush=True)
                write_json(args.out, doc)
            del t
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
