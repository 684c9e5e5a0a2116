"""The lm head + loss in row chunks, each chunk's CE kernel on a side stream beside the GEMMs
(models/common/overlap.py), against one chunk and against the three GEMMs alone, in one
process, their graph replays' rounds interleaved.

    python3 benchmarks/loss_overlap.py [--tokens 16384] [--chunks 0,8192,4096,2048]
        [--serial 4096] [--rounds 9] [--out PATH]

bf16 x [T, H], w [V, H] (Qwen3: V = 151936, H = 2048; w ~ N(0, 0.02)), labels with 10%
ignored. Each entry is one CUDA graph of what the trainer runs: linear_cross_entropy with
inplace_backward (the logits buffer becomes dlogits), dx by autograd, dW written into the
weight's gradient sink. Entries: `c0` (one chunk: the path before chunking), `twin` (c0 again:
the run's resolution), `cN` per --chunks (N rows a chunk, side stream on), `cN_serial` per
--serial (the same chunks, no side stream: what the overlap itself buys), `gemms` (the logits,
dx and dW GEMMs alone, no CE kernel: the floor the overlap aims at) and `ce` (the two CE
kernels alone on the logits). Each entry's loss, dx and dW are compared with c0's (bitwise, and
the max abs difference: a GEMM over fewer rows may take another cuBLAS kernel). Then --rounds
rounds, every graph replayed back to back for about 150 ms, each burst led by as long a burst
of c0's, the order shuffled a round (common.interleaved_ms): the median ms, its SM clock, the
ratio to c0 and the ms above `gemms`.

Writes loss_overlap.json (--out; default $OUT/loss_overlap.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import math
import sys

from common import capture_graph, default_out, environment, error_text, interleaved_ms, \
    write_json


def make_case(T, V, H, seed=0):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[::10] = -100
    return x, w, labels


def entries(chunks: list[int], serial: list[int]) -> dict:
    """{name: (kind, chunk_rows, side stream on)}."""
    out = {"c0": ("loss", 0, True), "twin": ("loss", 0, True)}
    out.update({f"c{c}": ("loss", c, True) for c in chunks if c})
    out.update({f"c{c}_serial": ("loss", c, False) for c in serial if c})
    out["gemms"] = ("gemms", 0, False)
    out["ce"] = ("ce", 0, False)
    return out


def bodies(x, w, labels, outs):
    """{kind: fn(name, chunk_rows, side) -> a body to capture} writing into outs[name]."""
    import torch
    from moegraph_cli import grads
    from moegraph_cli.models.common import overlap
    from moegraph_cli.models.common.loss import linear_cross_entropy
    from moegraph_kernels import cross_entropy as ce

    def loss(name, chunk_rows, side):
        def body():
            real = overlap.side_stream
            if not side:
                overlap.side_stream = lambda device: None
            try:
                xl = x.detach().requires_grad_()
                with grads.backward_pass(accumulate=False):
                    value, _ = linear_cross_entropy(xl, w, labels, inplace_backward=True,
                                                    chunk_rows=chunk_rows)
                    (dx,) = torch.autograd.grad(value, [xl])
                outs[name] = (value.detach(), dx)
            finally:
                overlap.side_stream = real
        return body

    def gemms(name, chunk_rows, side):
        def body():
            logits = x @ w.t()
            dx = logits @ w
            torch.mm(logits.t(), x, out=w.grad)
            outs[name] = (None, dx)
        return body

    logits = x @ w.t()
    n_valid = (labels != -100).sum()
    one = torch.ones((), device="cuda")

    def ce_only(name, chunk_rows, side):
        def body():
            lse, _ = ce.cross_entropy_forward(logits, labels)
            ce.cross_entropy_backward(logits, labels, lse, one, n_valid, out_TV=logits)
            outs[name] = (None, None)
        return body

    return {"loss": loss, "gemms": gemms, "ce": ce_only}


def run_case(T, V, H, args) -> list[dict]:
    import torch
    from moegraph_cli import grads
    x, w, labels = make_case(T, V, H)
    w.requires_grad_()
    w.grad = torch.zeros_like(w)
    grads.sink(w)
    outs, graphs, recs, dws = {}, {}, [], {}
    make = bodies(x, w, labels, outs)
    for name, (kind, chunk_rows, side) in entries(args.chunk_list, args.serial_list).items():
        rec = {"T": T, "V": V, "H": H, "entry": name, "kind": kind, "chunk_rows": chunk_rows,
               "side_stream": side}
        try:
            graphs[name] = capture_graph(make[kind](name, chunk_rows, side))
            w.grad.fill_(math.nan)
            graphs[name].replay()
            torch.cuda.synchronize()
            if kind == "loss":
                dws[name] = w.grad.clone()
                got, want = (*outs[name], dws[name]), (*outs["c0"], dws["c0"])
                rec["equal_c0"] = all(torch.equal(a, b) for a, b in zip(got, want))
                rec["max_abs_vs_c0"] = {
                    n: (a.float() - b.float()).abs().max().item()
                    for n, a, b in zip(("loss", "dx", "dw"), got, want)}
                rec["loss"] = outs[name][0].item()
        except Exception as exc:  # noqa: BLE001 - a failing entry: recorded, the run goes on
            rec["error"] = error_text(exc)
        recs.append(rec)
        print(rec, file=sys.stderr, flush=True)
    if "c0" in graphs:
        one = interleaved_ms({"c0": graphs["c0"].replay}, 1, 1, warmup=2)
        reps = max(2, round(150 / max(one["c0"]["ms"], 1e-3)))
        timed = interleaved_ms({n: g.replay for n, g in graphs.items()}, reps, args.rounds,
                               warmup=1, lead=graphs["c0"].replay)
        flops = 3 * 2 * T * V * H
        for rec in recs:
            if rec["entry"] in timed:
                rec.update(timed[rec["entry"]], reps=reps)
                rec["ratio_to_c0"] = rec["ms"] / timed["c0"]["ms"]
                if "gemms" in timed:
                    rec["ms_over_gemms"] = rec["ms"] - timed["gemms"]["ms"]
                if rec["kind"] != "ce":
                    rec["gemm_tflops"] = flops / rec["ms"] / 1e9
    del graphs, outs, dws
    torch.cuda.empty_cache()
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16384", help="comma list of T")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--chunks", default="8192,4096,2048", help="rows a chunk, side stream on")
    ap.add_argument("--serial", default="4096", help="rows a chunk, side stream off")
    ap.add_argument("--rounds", type=int, default=9, help="timing rounds (median)")
    ap.add_argument("--out", default=str(default_out("loss_overlap.json")))
    args = ap.parse_args()
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
        args.chunk_list = [int(c) for c in args.chunks.split(",") if c]
        args.serial_list = [int(c) for c in args.serial.split(",") if c]
    except ValueError:
        ap.error("--tokens, --chunks and --serial take comma lists of integers")
    import torch
    if not torch.cuda.is_available():
        sys.exit("loss_overlap.py: needs a CUDA GPU")
    doc = {**environment(), "records": []}
    for T in tokens:
        doc["records"] += run_case(T, args.vocab, args.hidden, args)
        write_json(args.out, doc)
    for rec in doc["records"]:
        if "ms" in rec:
            print(f"T={rec['T']:6d} {rec['entry']:14s} {rec['ms']:8.3f} ms "
                  f"x{rec['ratio_to_c0']:.3f} +{rec.get('ms_over_gemms', 0):.3f} over gemms "
                  f"{rec['sm_mhz']} MHz equal={rec.get('equal_c0')}")


if __name__ == "__main__":
    main()
