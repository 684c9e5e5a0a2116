"""16-bit GEMMs on the CPU: torch's own bf16 product against moegraph_cli/matmul.py's (fp32
copies, one rounding), at the built-in default's shapes; then the CPU main job's wall time.

    python3 benchmarks/cpu_gemm.py [--repeats 3] [--tokens 1024] [--vocab 32000] [--no-verify]
                                   [--out PATH]

A CPU measurement: nothing here touches a GPU (the record says so). Shapes, for 1024 tokens
(tiny-qwen3-moe's 2 x 512): the lm head (V = 32000, H = 512) forward x w^T, dx = dlogits w
and dW = dlogits^T x; a q/k/v-sized projection (N = 1536) the same three. Each product is
timed `--repeats` times after one call, median seconds; the bf16 dx of the lm head once.
Then `moegraph verify --set run.device=cpu --json` (the README's main job without a GPU) in a
fresh process, wall seconds, with its verdict.

Prints the JSON and writes cpu_gemm.json (--out; default $OUT/cpu_gemm.json, else
benchmarks/results/cpu_gemm.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from common import REPO, default_out, environment, write_json


def seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def products(tokens: int, vocab: int, hidden: int, proj: int):
    """(name, (a, b)) per case: the product a @ b is what is timed."""
    import torch
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    x, w_head, d_head = r(tokens, hidden), r(vocab, hidden), r(tokens, vocab)
    w_proj, d_proj = r(proj, hidden), r(tokens, proj)
    return [("lm_head_fwd", (x, w_head.t())), ("lm_head_dx", (d_head, w_head)),
            ("lm_head_dW", (d_head.t(), x)), ("proj_fwd", (x, w_proj.t())),
            ("proj_dx", (d_proj, w_proj)), ("proj_dW", (d_proj.t(), x))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--no-verify", action="store_true", help="skip the verify run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from moegraph_cli import matmul
    doc = {**environment(device=False), "cpu": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "records": []}
    out = args.out or default_out("cpu_gemm.json")
    for name, (a, b) in products(args.tokens, args.vocab, 512, 1536):
        rec = {"product": name, "shape": [list(a.shape), list(b.shape)]}
        reps = 1 if name == "lm_head_dx" else args.repeats
        rec["bf16_torch_s"] = seconds(lambda: torch.matmul(a, b), reps)
        rec["fp32_copies_s"] = seconds(lambda: matmul.matmul(a, b), args.repeats)
        rec["speedup"] = rec["bf16_torch_s"] / rec["fp32_copies_s"]
        doc["records"].append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        write_json(out, doc)
    if not args.no_verify:
        cmd = [sys.executable, "-m", "moegraph_cli.app", "verify", "--set", "run.device=cpu",
               "--json"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        run = {"command": "moegraph verify --set run.device=cpu --json", "wall_s": wall,
               "exit": p.returncode}
        try:
            v = json.loads(p.stdout)
            run.update(passed=v.get("passed"), verdict=v.get("verdict"), steps=v.get("steps"))
        except json.JSONDecodeError:
            run["stderr_tail"] = p.stderr[-400:]
        doc["verify"] = run
        write_json(out, doc)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
