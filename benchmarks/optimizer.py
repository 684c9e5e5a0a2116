"""AdamW step on one GPU: copy bandwidth, torch fused AdamW, FlatAdamW eager and graphed.

    python3 benchmarks/optimizer.py [--params 3.1e9] [--dtype bf16] [--iters 20] [--out PATH]

The parameters mimic a transformer: the shapes of profile qwen3-30b-a3b-4layer (embedding,
lm_head, four MoE layers: 3.11e9 parameters), with the layer shapes repeated or dropped to get
near --params; values N(0, 0.02), gradients N(0, 1) (never zeros). Measured, each after warm-up
with CUDA events, median of --iters:
  (a) copy: dst.copy_(src) of a flat 4 GiB buffer; bandwidth = 2 * bytes / time (read + write);
  (b) torch.optim.AdamW(fused=True) over the parameter list;
  (c) FlatAdamW.step() (moegraph_cli/train/optim.py) over the same shapes;
  (d) FlatAdamW.step() captured in a CUDA graph, replayed.
Bandwidth of an AdamW step = 7 * element size bytes per parameter (read p, g, m, v; write p, m,
v: 14 B in bf16), reported with its fraction of (a). Each implementation holds about
4 * params * element size bytes (25 GB at 3.1e9 bf16); each is freed before the next.
First, on a subset (layer 0 without w_gate_up, 0.22e9 parameters), FlatAdamW against fused
torch AdamW from the same parameters and gradients: max ulp difference of p, exp_avg and
exp_avg_sq after the first step and after the third.

Prints the JSON and writes it to optimizer.json (--out; default $OUT/optimizer.json, else
benchmarks/results/optimizer.json), with the GPU, torch and Triton versions, commit and date.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from common import count_kernels, default_out, environment, time_ms, write_json
from moegraph_cli.config import load_profile
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.optim import FlatAdamW

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LR, WEIGHT_DECAY = 1e-4, 0.1
COPY_BYTES = 4 << 30


def transformer_shapes(target: float) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(shapes totalling about `target` elements, the check subset's shapes)."""
    prof = load_profile("qwen3-30b-a3b-4layer")
    with torch.device("meta"):
        model = MoeCausalLM(prof.model, prof.moe)
    outer, layer = [], []
    for name, p in model.named_parameters():
        if name.startswith("layers.0."):
            layer.append(tuple(p.shape))
        elif not name.startswith("layers."):
            outer.append(tuple(p.shape))
    numel = lambda shapes: sum(torch.Size(s).numel() for s in shapes)  # noqa: E731
    layers = max(1, round((target - numel(outer)) / numel(layer)))
    biggest = max(layer, key=lambda s: torch.Size(s).numel())  # w_gate_up
    subset = [s for s in layer if s != biggest]
    return outer + layer * layers, subset


def make_params(shapes, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.empty(s, device="cuda", dtype=dtype)
        p.normal_(0.0, 0.02, generator=gen)
        p.requires_grad_()
        p.grad = torch.empty_like(p).normal_(0.0, 1.0, generator=gen)
        params.append(p)
    return params


def free() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(max |a - b| in ulps of a's dtype, elements that differ); ordered bit patterns, so
    +0 == -0 and a sign change counts the ulps between the two through zero."""
    int_type = {2: torch.int16, 4: torch.int32}[a.element_size()]
    sign = {2: 0x7FFF, 4: 0x7FFFFFFF}[a.element_size()]

    def ordered(t):
        bits = t.contiguous().view(int_type).long()
        return torch.where(bits < 0, -(bits & sign), bits)
    diff = (ordered(a) - ordered(b)).abs()
    return int(diff.max()), int((diff != 0).sum())


def check_against_fused(shapes, dtype, steps=(1, 3)) -> dict:
    """[max ulps, elements that differ] of p, exp_avg, exp_avg_sq between FlatAdamW and fused
    torch AdamW after each step in `steps`, both from the same parameters and gradients."""
    mine, ref = make_params(shapes, dtype, 1), make_params(shapes, dtype, 1)
    opt = FlatAdamW(mine, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    group = opt.groups[0]
    gen = torch.Generator(device="cuda").manual_seed(2)
    out = {"params": sum(p.numel() for p in mine)}
    for step in range(1, max(steps) + 1):
        if step > 1:
            for p, r in zip(mine, ref):
                r.grad.copy_(p.grad.normal_(0.0, 1.0, generator=gen))
        opt.step()
        ref_opt.step()
        if step not in steps:
            continue
        worst = {name: [0, 0] for name in ("p", "exp_avg", "exp_avg_sq")}
        for i, (p, r) in enumerate(zip(mine, ref)):
            sl = slice(group.offsets[i], group.offsets[i] + p.numel())
            state = ref_opt.state[r]
            pairs = {"p": (p.detach(), r.detach()),
                     "exp_avg": (group.exp_avg[sl], state["exp_avg"].view(-1)),
                     "exp_avg_sq": (group.exp_avg_sq[sl], state["exp_avg_sq"].view(-1))}
            for name, (x, y) in pairs.items():
                most, count = ulps(x, y)
                worst[name] = [max(worst[name][0], most), worst[name][1] + count]
        out[f"step_{step}"] = worst
    del mine, ref, opt, ref_opt, group
    free()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(default_out("optimizer.json")))
    ap.add_argument("--params", type=float, default=3.1e9)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/optimizer.py: needs a CUDA GPU (none is visible)")
    dtype = DTYPES[args.dtype]
    shapes, subset = transformer_shapes(args.params)
    numel = sum(torch.Size(s).numel() for s in shapes)
    step_bytes = 7 * numel * dtype.itemsize
    doc = {
        "benchmark": "optimizer", **environment(),
        "dtype": args.dtype, "params": numel, "tensors": len(shapes),
        "bytes_per_step": step_bytes, "iters": args.iters, "lr": LR,
        "weight_decay": WEIGHT_DECAY,
    }
    doc["max_ulps_vs_fused"] = check_against_fused(subset, dtype)
    print("max ulps vs fused:", doc["max_ulps_vs_fused"], flush=True)

    src = torch.empty(COPY_BYTES // 2, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), iters=args.iters)
    copy_gbps = 2 * COPY_BYTES / copy_ms / 1e6
    doc["copy"] = {"bytes": COPY_BYTES, "ms": copy_ms, "GBps": copy_gbps}
    del src, dst
    free()

    def record(name, ms, kernels=None):
        gbps = step_bytes / ms / 1e6
        doc[name] = {"ms": ms, "GBps": gbps, "fraction_of_copy": gbps / copy_gbps}
        if kernels is not None:
            doc[name]["kernels"] = kernels
        print(f"{name:16s} {ms:8.3f} ms {gbps:7.0f} GB/s {gbps / copy_gbps:6.1%} of copy",
              flush=True)

    params = make_params(shapes, dtype, 0)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    record("torch_fused", time_ms(opt.step, iters=args.iters), count_kernels(opt.step))
    del params, opt
    free()

    params = make_params(shapes, dtype, 0)
    opt = FlatAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    free()  # the packing copied each parameter into the flat buffer: the originals are gone
    doc["flat_state_bytes"] = opt.state_bytes()
    doc["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    record("flat_eager", time_ms(opt.step, iters=args.iters), count_kernels(opt.step))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        opt.step()
    record("flat_graph", time_ms(graph.replay, iters=args.iters))
    del params, opt, graph
    free()

    print(json.dumps(doc, indent=2))
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
