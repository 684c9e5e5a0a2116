"""Eager training-step baseline on the GPU: moegraph's eager model (permute-free experts)
against transformers' Qwen3MoeForCausalLM with its eager and grouped_mm experts, same shapes.

Per (profile, impl): median step ms (fwd + bwd + fused AdamW), peak allocated bytes, CUDA
kernels per step. Run: python3 benchmarks/eager_baseline.py --out $OUT/eager_baseline.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import count_kernels, time_ms, write_records  # noqa: E402

from moegraph_cli.config import load_profile  # noqa: E402
from moegraph_cli.train.harness import device_info  # noqa: E402
from moegraph_cli.models import MoeCausalLM  # noqa: E402
from moegraph_cli.train.trainer import Trainer, synthetic_batch  # noqa: E402


def moegraph_step(prof, backend):
    prof.moe.backend = backend
    model = MoeCausalLM.from_config(prof.model, prof.moe, 0, torch.bfloat16, "cuda")
    trainer = Trainer(model, lr=1e-5)
    return model, lambda ids: trainer.step(ids)


def hf_step(prof, impl):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = prof.model.to_hf_dict()
    cfg = Qwen3MoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM._from_config(cfg, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa",
                                                 experts_implementation=impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(ids):
        opt.zero_grad(set_to_none=False)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        opt.step()
        return out.loss.detach()
    return model, step


IMPLS = {"moegraph-eager": lambda p: moegraph_step(p, "permute_free"),
         "transformers-eager": lambda p: hf_step(p, "eager"),
         "transformers-grouped_mm": lambda p: hf_step(p, "grouped_mm")}


def run_case(profile: str, impl: str, iters: int) -> dict:
    prof = load_profile(profile)
    ids = synthetic_batch(prof.model.vocab_size, prof.run.batch, prof.run.seq_len, 0, 0, "cuda")
    rec = {"profile": profile, "impl": impl, "batch": prof.run.batch,
           "seq_len": prof.run.seq_len, **device_info()}
    try:
        model, step = IMPLS[impl](prof)
        step(ids)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        rec["step_ms"] = time_ms(lambda: step(ids), warmup=2, iters=iters)
        rec["peak_bytes"] = torch.cuda.max_memory_allocated()
        rec["peak_reserved"] = torch.cuda.max_memory_reserved()
        rec["kernels"] = count_kernels(lambda: step(ids))
        rec["loss"] = float(step(ids))
    except Exception as e:  # noqa: BLE001 - record the failure and go on
        rec.update(step_ms=None, peak_bytes=None, kernels=None,
                   error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        traceback.print_exc()
    model = step = None
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", default="tiny-qwen3-moe,qwen3-30b-a3b-4layer")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/eager_baseline.json")
    args = ap.parse_args()
    records = [run_case(p, i, args.iters) for p in args.profiles.split(",")
               for i in args.impls.split(",")]
    write_records(records, args.out)
    print(f"{'profile':24} {'impl':26} {'step_ms':>9} {'peak GiB':>9} {'kernels':>8}")
    for r in records:
        ms = "-" if r.get("step_ms") is None else f"{r['step_ms']:.2f}"
        pk = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**30:.2f}"
        print(f"{r['profile']:24} {r['impl']:26} {ms:>9} {pk:>9} {str(r.get('kernels')):>8}"
              + (f"  {r['error']}" if r.get("error") else ""))


if __name__ == "__main__":
    main()
