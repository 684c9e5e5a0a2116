"""The optimizer step under the backward (`run.optim_overlap`, train/overlap.py) against the
step after the backward, side by side in one process on one model.

    python3 benchmarks/optim_overlap.py [--profile qwen3-30b-a3b-4layer] [--rounds 7]
        [--reps 4] [--modes eager,step] [--no-check] [--set SECTION.FIELD=VALUE ...]
        [--out PATH]

- `check` (eager, unless --no-check): from one saved state (parameters, AdamW states, step
  count), two steps plain, two plain again (the control: at load SDPA's backward need not
  repeat itself) and two overlapped, on the same batches: losses and every parameter compared
  bitwise.
- `timing`: `eager_plain`, `eager_overlap` (the trainer with its overlap on or off) and, for
  `step`, `step_plain` / `step_overlap` (the whole step captured twice, once each way, on one
  trainer), each timed as `--reps` steps back to back between two CUDA events, the modes'
  rounds interleaved in shuffled orders (common.interleaved_ms); the median round, ms a step,
  and the SM clock NVML read during it.
- `power`: per mode, one more burst while a thread samples NVML's board power and SM clock
  every 20 ms: their means (the step runs at the board's power limit when these are flat),
  and the board's energy a step from NVML's energy counter over the burst.
- `parts` (--parts): the same power burst for the step's two halves alone, eager: the
  forward and backward without the update, and the AdamW update alone (the optimizer's
  `step()` over the gradients left in place): where the step's energy goes.
- the overlap's own counters: fences run and parameters updated early in a step.

Writes optim_overlap.json (--out; default $OUT/optim_overlap.json, else
benchmarks/results/optim_overlap.json).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from common import default_out, environment, error_text, interleaved_ms, write_json


def power_burst(fn, reps: int) -> dict:
    """Mean board power (W) and SM clock (MHz) while `reps` calls of fn run."""
    import pynvml
    import torch
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    watts, mhz, stop = [], [], threading.Event()
    try:
        energy = pynvml.nvmlDeviceGetTotalEnergyConsumption  # mJ since the driver loaded
        energy(h)
    except Exception:  # noqa: BLE001 - older boards have no counter
        energy = None

    def sample():
        while not stop.is_set():
            watts.append(pynvml.nvmlDeviceGetPowerUsage(h) / 1e3)
            mhz.append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
            time.sleep(0.02)
    torch.cuda.synchronize()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    e0 = energy(h) if energy else None
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    e1 = energy(h) if energy else None
    stop.set()
    t.join()
    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3
    return {"watts_mean": statistics.fmean(watts) if watts else None,
            "sm_mhz_mean": statistics.fmean(mhz) if mhz else None,
            "samples": len(watts), "power_limit_w": limit,
            "joules_per_call": (e1 - e0) / 1e3 / reps if energy else None}


def check_bitwise(trainer, ids_list) -> dict:
    """From one saved state: one step plain, then again plain (the control), overlapped on
    the side stream, and overlapped inline (early updates on the current stream); each
    compared parameter by parameter with the first, then a second step's loss."""
    import torch
    from moegraph_cli.train.overlap import OptimizerOverlap
    opt = trainer.optimizer
    saved = [t.clone() for g in opt.groups for t in (g.param, g.exp_avg, g.exp_avg_sq)]
    saved_steps = [s.step.clone() for s in opt._scalars.values()]
    names = {id(p): n for n, p in trainer.model.named_parameters()}

    def restore():
        i = 0
        for g in opt.groups:
            for t in (g.param, g.exp_avg, g.exp_avg_sq):
                t.copy_(saved[i])
                i += 1
        for s, v in zip(opt._scalars.values(), saved_steps):
            s.step.copy_(v)

    ov = trainer.overlap
    inline = OptimizerOverlap(trainer.model, opt, side_stream=False)
    inline.expected = dict(ov.expected)
    out = {}
    first = None
    for name, mode in (("plain", None), ("plain_again", None), ("overlap", ov),
                       ("overlap_inline", inline)):
        restore()
        trainer.overlap = mode
        losses = [float(trainer.step(ids_list[0]))]
        torch.cuda.synchronize()
        if first is None:
            first = {id(p): p.detach().clone() for p in opt.params}
            differ = []
        else:
            differ = [names[id(p)] for p in opt.params if not torch.equal(first[id(p)], p)]
        losses.append(float(trainer.step(ids_list[1])))
        out[name] = {"losses": losses, "params_differing_after_one_step": len(differ),
                     "differing_nearest_the_loss": differ[-8:]}
        if mode is not None:
            out[name].update(early_updates=mode.early, fences=mode.fences)
    restore()
    trainer.overlap = ov
    del saved, first
    torch.cuda.empty_cache()
    out["plain_repeats_bitwise"] = (out["plain_again"]["params_differing_after_one_step"] == 0
                                    and out["plain"]["losses"] == out["plain_again"]["losses"])
    for name in ("overlap", "overlap_inline"):
        out[f"{name}_bitwise"] = (out[name]["params_differing_after_one_step"] == 0
                                  and out[name]["losses"] == out["plain"]["losses"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="qwen3-30b-a3b-4layer")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--modes", default="eager,step")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from moegraph_cli.train.harness import GraphTrainer, capture_into, step_graph
    from moegraph_cli.train.runspec import build_model, resolve
    from moegraph_cli.train.trainer import Trainer, batches

    out = args.out or default_out("optim_overlap.json")
    doc = {"benchmark": "optim_overlap", **environment(), "profile": args.profile,
           "set": args.set}
    spec = resolve(args.profile, None, args.set)
    prof, run = spec.profile, spec.profile.run
    doc.update(batch=run.batch, seq_len=run.seq_len)
    dev = torch.device("cuda")
    torch.manual_seed(run.seed)
    model = build_model(spec, dev)
    trainer = GraphTrainer(model, run.lr, run.weight_decay, optim_overlap=True)
    ov = trainer.overlap
    it = batches(prof.model.vocab_size, run.batch, run.seq_len, run.seed, dev)
    ids = next(it)
    trainer.step(ids)  # learns the write counts (nothing early yet)
    modes = args.modes.split(",")
    if not args.no_check:
        doc["check"] = check_bitwise(trainer, [next(it), next(it)])
        write_json(out, doc)

    def eager(on):
        def fn():
            trainer.overlap = ov if on else None
            Trainer.step(trainer, ids)
        return fn

    fns = {}
    if "eager" in modes:
        fns["eager_plain"], fns["eager_overlap"] = eager(False), eager(True)
    graphs = {}
    if "step" in modes:
        for name, on in (("step_plain", False), ("step_overlap", True)):
            trainer.overlap = ov if on else None
            g = step_graph(trainer)
            if capture_into(model, g, ids):
                graphs[name] = g
                fns[name] = g.graph.replay
            else:
                doc[f"{name}_failure"] = g.failure
        trainer.overlap = ov
    try:
        doc["timing"] = interleaved_ms(fns, args.reps, args.rounds, warmup=2)
        plain = {"eager_overlap": "eager_plain", "step_overlap": "step_plain"}
        for name, base in plain.items():
            if name in doc["timing"] and base in doc["timing"]:
                doc["timing"][name]["ratio_to_plain"] = \
                    doc["timing"][name]["ms"] / doc["timing"][base]["ms"]
        write_json(out, doc)
        doc["power"] = {name: power_burst(fn, args.reps * 2) for name, fn in fns.items()}
        if args.parts:
            trainer.overlap = None
            parts = {"forward_backward": lambda: Trainer.forward_backward(trainer, ids),
                     "adamw": trainer.optimizer.step}
            doc["parts"] = {name: power_burst(fn, args.reps * 2) for name, fn in parts.items()}
            for name, fn in parts.items():
                doc["parts"][name]["ms"] = interleaved_ms({name: fn}, args.reps, 3)[name]["ms"]
    except Exception as e:  # noqa: BLE001 - keep what was measured
        doc["error"] = error_text(e)
    trainer.overlap = ov
    eager(True)()
    doc["overlap_counters"] = {"fences": ov.fences, "early_updates": ov.early,
                               "params": len(ov.params)}
    doc["peak_allocated"] = torch.cuda.max_memory_allocated()
    write_json(out, doc)
    print(out)


if __name__ == "__main__":
    main()
