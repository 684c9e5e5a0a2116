"""Energy per FLOP of the loaded step's big parts, each captured in a CUDA graph and replayed
back to back for about a second while NVML's energy counter runs.

    python3 benchmarks/energy.py [--tokens 16384] [--routing uniform,skewed] [--burst-s 1.5]
        [--rounds 2] [--out PATH]

Parts (bf16, the 4-layer Qwen3-30B's shapes at 4 x 4096 tokens):
- `experts_fwd_bwd`: the permute-free experts' forward + backward (E = 128, k = 8, H = 2048,
  F = 768, T tokens; useful FLOPs 3 x 2 T k H 3F);
- `lm_head_gemm`: the lm head's forward GEMM, [T, 2048] @ [2048, 151936] (cuBLAS);
- `attention_fwd_bwd`: SDPA's causal GQA attention, 4 x 4096, 32 / 4 heads of 128 (FLOPs
  3.5 x the causal forward's 2 B N S^2 D: the forward and a backward of 2.5 times it).
Per part and round (every part's graph captured first, then `--rounds` rounds of one burst
each): ms a call, mean board power (W) and joules a call from the counter, TFLOP/s, and
joules per TFLOP. Under the board's power limit the step's time is its energy over the
limit, so J/TFLOP says which part costs the most time per unit of work.

Writes energy.json (--out; default $OUT/energy.json, else benchmarks/results/energy.json).
"""

from __future__ import annotations

import argparse
import time

from common import capture_graph, default_out, environment, error_text, nvml_device, write_json
from determinism import ATTENTION_SHAPE, attention_case
from experts import SHAPES, make_case


def burst(graph, seconds: float) -> dict:
    import torch
    pynvml, h = nvml_device()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(5, round(seconds / max(time.perf_counter() - t0, 1e-5)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    e1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    ms = start.elapsed_time(end) / reps
    joules = (e1 - e0) / 1e3 / reps
    return {"reps": reps, "ms": ms, "joules": joules, "watts": joules / ms * 1e3,
            "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3}


def experts_graph(T: int, routing: str):
    import torch
    from moegraph_cli.moe.experts import permute_free_moe
    args, dout = make_case(SHAPES["qwen3"], T, routing, 0.25)
    leaves = [a for a in args if a.is_floating_point()]

    def body():
        y = permute_free_moe(*args)
        torch.autograd.grad(y, leaves, dout)
    E, H, F, k = SHAPES["qwen3"]
    return capture_graph(body), 3 * 2 * T * k * H * 3 * F, (args, dout)


def lm_head_graph(T: int):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(151936, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty(T, 151936, device="cuda", dtype=torch.bfloat16)
    return capture_graph(lambda: torch.mm(x, w.t(), out=out)), 2 * T * 2048 * 151936, (x, w, out)


def attention_graph():
    import torch
    import torch.nn.functional as F
    q, k, v, do = attention_case()
    B, S, NQ, _, D = ATTENTION_SHAPE
    leaves = [q, k, v]

    def body():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, leaves, do)
    return capture_graph(body), int(3.5 * 2 * B * NQ * S * S * D), (q, k, v, do)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--burst-s", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    out = args.out or default_out("energy.json")
    doc = {"benchmark": "energy", **environment(), "tokens": args.tokens, "records": []}
    makers = [(f"experts_fwd_bwd_{r}", lambda r=r: experts_graph(args.tokens, r))
              for r in args.routing.split(",")]
    makers += [("lm_head_gemm", lambda: lm_head_graph(args.tokens)),
               ("attention_fwd_bwd", attention_graph)]
    graphs = {}  # name -> (graph, flops, the inputs it reads: kept alive with it)
    for name, make in makers:
        try:
            graphs[name] = make()
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            doc["records"].append({"part": name, "error": error_text(e)})
    for rnd in range(args.rounds):
        for name, (graph, flops, _inputs) in graphs.items():
            rec = {"part": name, "round": rnd}
            try:
                rec.update(burst(graph, args.burst_s), flops=flops)
                rec["tflops"] = flops / rec["ms"] / 1e9
                rec["joules_per_tflop"] = rec["joules"] / (flops / 1e12)
            except Exception as e:  # noqa: BLE001
                rec["error"] = error_text(e)
            doc["records"].append(rec)
            write_json(out, doc)
    del graphs
    torch.cuda.empty_cache()
    write_json(out, doc)
    print(out)


if __name__ == "__main__":
    main()
