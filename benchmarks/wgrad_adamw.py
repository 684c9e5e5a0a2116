"""The expert weights' AdamW step in the dW kernels' epilogue (kernels/wgrad.py `adamw=`)
against the unfused path (dW stored, then kernels/adamw.adamw_step over it), in one process,
their graph replays' rounds interleaved: what fusing the expert optimizer into the backward
would buy.

    python3 benchmarks/wgrad_adamw.py [--tokens 8192,16384] [--routing uniform,skewed]
        [--skew 0.25] [--rounds 7] [--out PATH]

Per (T, routing), Qwen3 expert shape (E = 128, k = 8, H = 2048, F = 768), bf16: dW_down and
dW_gate_up of one layer under the product's tiles (wgrad_config), the two weights, their
exp_avg and exp_avg_sq each one flat buffer as the optimizer keeps them (604M parameters).
Entries, each one CUDA graph: `unfused` (both dW kernels into the gradient buffer, then one
adamw_step over the flat buffers), `twin` (unfused again), `fused` (both dW kernels with the
AdamW epilogue: no gradient stored or read), `wgrad` (the two dW kernels alone) and `adamw`
(adamw_step alone). From the same state `fused` and `unfused` are compared bitwise (weights
and both moments). Then --rounds rounds, each graph replayed back to back for about 100 ms,
each burst led by as long a burst of `unfused`, the order shuffled a round
(common.interleaved_ms): median ms, SM clock, ratio to `unfused`.

Writes wgrad_adamw.json (--out; default $OUT/wgrad_adamw.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import sys

from common import capture_graph, default_out, environment, error_text, interleaved_ms, \
    write_json
from experts import SHAPES, load_stats, make_routing


def make_state(T, routing, skew):
    import torch
    from moegraph_cli.moe.experts import build_routes
    from moegraph_kernels.gemm_config import route_block_m
    E, H, F, k = SHAPES["qwen3"]
    dev, bf = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    ids, w = make_routing(T, E, k, routing, skew)
    routes = build_routes(ids.to(dev), w.to(dev), E, route_block_m(T * k, E, dev), None)
    S = routes.num_slots
    x = torch.randn(T, H, device=dev, generator=gen).to(bf)
    dout = torch.randn(T, H, device=dev, generator=gen).to(bf)
    dy1 = (torch.randn(S, 2 * F, device=dev, generator=gen) * 0.1).to(bf)
    act = torch.randn(S, F, device=dev, generator=gen).to(bf)
    n_down, n_gu = E * H * F, E * 2 * F * H
    flat = {name: torch.empty(n_down + n_gu, device=dev, dtype=bf) for name in "pgmv"}
    flat["p"].normal_(0, 0.02, generator=gen)
    flat["m"].normal_(0, 1e-3, generator=gen)
    flat["v"].uniform_(0, 1e-6, generator=gen)
    views = {name: (buf[:n_down].view(E, H, F), buf[n_down:].view(E, 2 * F, H))
             for name, buf in flat.items()}
    return routes, (x, dout, dy1, act), flat, views, ids


def bodies(T, routes, rows, flat, views):
    import torch
    import moegraph_kernels.wgrad as wg
    from moegraph_kernels.adamw import adamw_step, bias_correction_
    E, H, F, k = SHAPES["qwen3"]
    dev = flat["p"].device
    x, dout, dy1, act = rows
    cfg_down = wg.wgrad_config(F, dev, T * k / E)
    cfg_gu = wg.wgrad_config(H, dev, T * k / E, slot_order_l=True)
    hp = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    lr = torch.tensor([1e-5], dtype=torch.float32, device=dev)
    bias = torch.empty(5, dtype=torch.float64, device=dev)
    bias_correction_(torch.tensor([10], device=dev),
                     torch.tensor([0.9, 0.95, 0.5], dtype=torch.float64, device=dev),
                     torch.tensor([0.9, 0.95, 0, 0], dtype=torch.float32, device=dev), bias)
    hyper = wg.adamw_hyper(**hp, device=dev)
    operands = ((dout, act, True, 0, cfg_down), (dy1, x, False, 1, cfg_gu))

    def wgrad():
        for l_rows, r_rows, gather_l, i, cfg in operands:
            wg.expert_wgrad(l_rows, r_rows, routes, views["g"][i], gather_l, not gather_l, cfg)

    def adamw():
        adamw_step(flat["p"], flat["g"], flat["m"], flat["v"], lr, bias, **hp)

    def unfused():
        wgrad()
        adamw()

    def fused():
        for l_rows, r_rows, gather_l, i, cfg in operands:
            p, m, v = (views[n][i] for n in "pmv")
            wg.expert_wgrad(l_rows, r_rows, routes, p, gather_l, not gather_l, cfg,
                            adamw=wg.AdamWEpilogue(p, m, v, lr, bias, hyper))

    return {"unfused": unfused, "twin": unfused, "fused": fused, "wgrad": wgrad,
            "adamw": adamw}


def run_case(T, routing, args) -> list[dict]:
    import torch
    E, H, F, k = SHAPES["qwen3"]
    routes, rows, flat, views, ids = make_state(T, routing, args.skew)
    fns = bodies(T, routes, rows, flat, views)
    base = {"T": T, "routing": routing, "skew": args.skew if routing == "skewed" else 0,
            "load": load_stats(ids, E), "params": flat["p"].numel()}
    # From one state: the fused update against the unfused one, bitwise.
    start = {n: flat[n].clone() for n in "pmv"}
    fns["unfused"]()
    want = {n: flat[n].clone() for n in "pmv"}
    for n in "pmv":
        flat[n].copy_(start[n])
    fns["fused"]()
    torch.cuda.synchronize()
    equal = {n: bool(torch.equal(flat[n], want[n])) for n in "pmv"}
    changed = {n: not torch.equal(flat[n], start[n]) for n in "pmv"}
    del start, want
    graphs, recs = {}, []
    for name, fn in fns.items():
        rec = {**base, "entry": name}
        if name == "fused":
            rec.update(equal_unfused=equal, updated=changed)
        try:
            graphs[name] = capture_graph(fn)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            rec["error"] = error_text(exc)
        recs.append(rec)
    if "unfused" in graphs:
        one = interleaved_ms({"u": graphs["unfused"].replay}, 1, 1, warmup=2)
        reps = max(3, round(100 / max(one["u"]["ms"], 1e-3)))
        timed = interleaved_ms({n: g.replay for n, g in graphs.items()}, reps, args.rounds,
                               warmup=1, lead=graphs["unfused"].replay)
        for rec in recs:
            if rec["entry"] in timed:
                rec.update(timed[rec["entry"]], reps=reps)
                rec["ratio_to_unfused"] = rec["ms"] / timed["unfused"]["ms"]
    del graphs
    torch.cuda.empty_cache()
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,16384", help="comma list of T")
    ap.add_argument("--routing", default="uniform,skewed", help="comma list of uniform, skewed")
    ap.add_argument("--skew", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=7, help="timing rounds (median)")
    ap.add_argument("--out", default=str(default_out("wgrad_adamw.json")))
    args = ap.parse_args()
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        ap.error("--tokens takes a comma list of integers")
    routings = [r for r in args.routing.split(",") if r]
    if not tokens or any(r not in ("uniform", "skewed") for r in routings):
        ap.error("--tokens needs a T and --routing takes uniform and/or skewed")
    import torch
    if not torch.cuda.is_available():
        sys.exit("wgrad_adamw.py: needs a CUDA GPU")
    doc = {**environment(), "records": []}
    for T in tokens:
        for routing in routings:
            doc["records"] += run_case(T, routing, args)
            write_json(args.out, doc)
            for rec in doc["records"][-5:]:
                if "ms" in rec:
                    print(f"T={T:6d} {routing:8s} {rec['entry']:8s} {rec['ms']:8.3f} ms "
                          f"x{rec['ratio_to_unfused']:.3f} @{rec['sm_mhz']} MHz "
                          f"{rec.get('equal_unfused', '')}", flush=True)
                else:
                    print(rec, flush=True)


if __name__ == "__main__":
    main()
