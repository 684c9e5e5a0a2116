"""transformers' own training step on a profile's shapes, for side-by-side comparison with
moegraph's capture (benchmarks/architectures.py runs it in a fresh process per profile).

The model is the family's transformers class (config built from the profile's config.json
fields, random weights, bf16, SDPA attention or the class's eager attention where it has no
SDPA), experts on `grouped_mm` where the class takes `experts_implementation` (else its
default), trained with torch's fused AdamW: median step ms (fwd + bwd + optimizer) over CUDA
events, peak reserved bytes.

Run: python3 benchmarks/hf_step.py --profile tiny-mixtral
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_ms  # noqa: E402

from moegraph_cli.config import load_profile  # noqa: E402
from moegraph_cli.train.harness import device_info  # noqa: E402
from moegraph_cli.train.trainer import synthetic_batch  # noqa: E402


def hf_model(prof, impl: str | None):
    import transformers

    d = prof.model.to_hf_dict()
    arch = d["architectures"][0]
    cfg_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = cfg_class(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    kwargs = {"dtype": torch.bfloat16}
    if impl is not None:
        kwargs["experts_implementation"] = impl
    with torch.device("cuda"):
        try:
            return getattr(transformers, arch)._from_config(cfg, attn_implementation="sdpa",
                                                            **kwargs)
        except ValueError as e:
            if "attention implementation" not in str(e):
                raise
            # A class without SDPA (GPT-OSS: its sinks) runs its eager attention.
            return getattr(transformers, arch)._from_config(cfg, attn_implementation="eager",
                                                            **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    prof = load_profile(args.profile)
    rec = {"profile": args.profile, "batch": prof.run.batch, "seq_len": prof.run.seq_len,
           **device_info()}
    try:
        try:
            model, rec["experts_implementation"] = hf_model(prof, "grouped_mm"), "grouped_mm"
        except (TypeError, ValueError) as e:  # the class takes no experts_implementation
            rec["grouped_mm_error"] = str(e).splitlines()[0][:200]
            model, rec["experts_implementation"] = hf_model(prof, None), "default"
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        ids = synthetic_batch(prof.model.vocab_size, prof.run.batch, prof.run.seq_len, 0, 0,
                              "cuda")

        def step():
            opt.zero_grad(set_to_none=False)
            out = model(input_ids=ids, labels=ids, output_router_logits=True)
            out.loss.backward()
            opt.step()
            return out.loss.detach()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        rec["step_ms"] = time_ms(step, warmup=2, iters=args.iters)
        rec["peak_reserved"] = torch.cuda.max_memory_reserved()
        rec["loss"] = float(step())
    except Exception as e:  # noqa: BLE001 - the record says what failed
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
