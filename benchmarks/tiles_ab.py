"""The whole expert fwd+bwd under the product's tile configs against alternatives, in one
process, their graph replays' rounds interleaved: a kernel change judged where it counts.

    python3 benchmarks/tiles_ab.py --alt NAME:KERNEL=SPEC[,KERNEL=SPEC...] [--alt ...]
        [--tokens 8192,32768] [--routing uniform,skewed] [--skew 0.25] [--rounds 9]
        [--forward] [--out PATH]

SPEC is kernel_sweep.py's spelling of a candidate: `128x128x64x8x8x5` (a tile: bm, bn, bk,
group, warps, stages; the default's variant kept), `+tma+persistent` (a variant: the default's
tile kept; `+base` the pointer path; `+keep+store` the default's variant plus store, whatever
it is at each T) or both (`256x128x64x4x8x3+tma`). KERNEL is one of
fc1, fc2, dact, dx, wgrad_down, wgrad_gate_up. Example:

    --alt dact5:dact=128x128x64x8x8x5 --alt dxp:dx=+tma+persistent

Per (T, routing), Qwen3 expert shape (E = 128, k = 8, H = 2048, F = 768; inputs and routing
as benchmarks/experts.py makes them): one graph per entry of autograd.grad of the permute-free
experts into fresh buffers (as a captured backward does): `default` (tile_configs), `twin`
(the default again: its distance from the default is the run's resolution), each --alt, and
`all` (every alt at once, where there are two or more). Each entry's output and four gradients
are compared with the default's (`equal_default`: bitwise, as the variants promise). Then
`--rounds` rounds in which every graph replays back to back for about 60 ms, each burst led by
as long an untimed burst of the default's, the order shuffled a round (common.interleaved_ms):
the median ms, the SM clock it ran at (NVML), TFLOP/s of useful FLOPs (3 x 2 T k H 3F;
--forward: the forward alone, its output compared, 2 T k H 3F) and the ratio to the default.
The kernels' fallback is off: a variant that fails is an error.

Writes tiles_ab.json (--out; default $OUT/tiles_ab.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import sys

from common import default_out, environment, graphed_ab, write_json
from experts import SHAPES, fwd_flops, leaves_of, load_stats, make_case

KERNELS = ("fc1", "fc2", "dact", "dx", "wgrad_down", "wgrad_gate_up")


def parse_spec(spec: str, default):
    """The GemmConfig SPEC names, from the default's (see the module docstring)."""
    tile, _, variant = spec.partition("+")
    cfg = default
    if tile:
        fields = tile.split("x")
        if len(fields) != 6 or not all(f.isdigit() for f in fields):
            raise ValueError(f"tile {tile!r}: want bm x bn x bk x group x warps x stages, "
                             "as 128x128x64x8x8x4")
        cfg = cfg._replace(**dict(zip(("block_m", "block_n", "block_k", "group_m",
                                       "num_warps", "num_stages"), map(int, fields))))
    if not variant:
        return cfg
    parts = variant.split("+")
    if "keep" in parts:  # the default's own parts, plus the others named
        parts = [p for p in parts if p != "keep"] + default.variant.split("+")
    return cfg.with_variant("+".join(parts))


def parse_alt(text: str) -> tuple[str, dict[str, str]]:
    """'NAME:KERNEL=SPEC,...' -> (NAME, {KERNEL: SPEC})."""
    name, sep, body = text.partition(":")
    if not sep or not name or not body:
        raise ValueError(f"--alt {text!r}: want NAME:KERNEL=SPEC[,KERNEL=SPEC...]")
    out = {}
    for part in body.split(","):
        kernel, eq, spec = part.partition("=")
        if not eq or kernel not in KERNELS or not spec:
            raise ValueError(f"--alt {text!r}: {part!r} is not KERNEL=SPEC with KERNEL one of "
                             f"{', '.join(KERNELS)}")
        out[kernel] = spec
    return name, out


def apply_alt(defaults, changes: dict[str, str]):
    """TileConfigs with each named kernel's config replaced."""
    return defaults._replace(**{k: parse_spec(s, getattr(defaults, k))
                                for k, s in changes.items()})


def entries(defaults, alts: list[tuple[str, dict]]) -> dict:
    """{name: TileConfigs}: default, twin, each alt, and all of them at once (two or more)."""
    out = {"default": defaults, "twin": defaults}
    for name, changes in alts:
        out[name] = apply_alt(defaults, changes)
    if len(alts) > 1:
        merged = {k: s for _, changes in alts for k, s in changes.items()}
        out["all"] = apply_alt(defaults, merged)
    return out


def run_case(T, routing, alts, args) -> list[dict]:
    import torch
    from moegraph_cli.moe.experts import permute_free_moe_with_drops, tile_configs
    E, H, F, k = SHAPES["qwen3"]
    case, dout = make_case((E, H, F, k), T, routing, args.skew)
    leaves = leaves_of(case)
    defaults = tile_configs(T * k, E, H, F, torch.device("cuda"))
    base = {"T": T, "routing": routing, "skew": args.skew if routing == "skewed" else 0,
            "load": load_stats(case[1], E)}
    fns, records = {}, {}
    for name, cfg in entries(defaults, alts).items():
        records[name] = {**base, "entry": name,
                         "configs": {kn: [*getattr(cfg, kn)[:6], getattr(cfg, kn).variant]
                                     for kn in KERNELS}}

        def fn(cfg=cfg):
            y = permute_free_moe_with_drops(*case, configs=cfg)[0]
            if args.forward:
                return [y.detach()]
            # y detached: kept with its autograd graph, the next capture's AccumulateGrad
            # nodes would meet the ones this capture's warm-up made on its side stream
            return [*torch.autograd.grad(y, leaves, dout), y.detach()]
        fns[name] = fn
    recs = graphed_ab(fns, records, args.rounds, 60)
    for rec in recs:
        if "ms" in rec:
            rec["tflops"] = (1 if args.forward else 3) * fwd_flops("qwen3", T) / rec["ms"] / 1e9
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alt", action="append", default=[],
                    help="NAME:KERNEL=SPEC[,KERNEL=SPEC...] (repeatable)")
    ap.add_argument("--tokens", default="8192,32768", help="comma list of T")
    ap.add_argument("--routing", default="uniform,skewed", help="comma list of uniform, skewed")
    ap.add_argument("--skew", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=9, help="timing rounds (median)")
    ap.add_argument("--forward", action="store_true",
                    help="time the forward alone (its output compared), not fwd+bwd")
    ap.add_argument("--out", default=str(default_out("tiles_ab.json")))
    args = ap.parse_args()
    try:
        alts = [parse_alt(a) for a in args.alt]
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    names = [n for n, _ in alts]
    if len(set(names)) != len(names) or {"default", "twin", "all"} & set(names):
        ap.error("--alt names must be distinct and not default, twin or all")
    bad = [r for r in args.routing.split(",") if r not in ("uniform", "skewed")]
    if bad:
        ap.error(f"unknown routing {bad[0]!r}; known: uniform, skewed")
    import torch
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tiles_ab.py: needs a CUDA GPU")
    from moegraph_cli.moe.experts import tile_configs
    try:  # a bad SPEC fails here, before any GPU work
        d = tile_configs(8192 * 8, 128, 2048, 768, torch.device("cuda"))
        entries(d, alts)
    except ValueError as exc:
        ap.error(str(exc))
    from moegraph_kernels import gemm_launch
    gemm_launch.FALLBACK_ON_ERROR = False
    doc = {"benchmark": "tiles_ab", **environment(), "alts": dict(alts),
           "forward": args.forward, "records": []}
    for T in tokens:
        for routing in args.routing.split(","):
            for rec in run_case(T, routing, alts, args):
                doc["records"].append(rec)
                print(f"T={T:6d} {routing:8s} {rec['entry']:12s} "
                      f"{rec.get('ms', float('nan')):8.3f} ms "
                      f"{rec.get('tflops', float('nan')):6.1f} TF/s "
                      f"x{rec.get('ratio_to_default', float('nan')):.3f} "
                      f"@{rec.get('sm_mhz')} MHz eq={rec.get('equal_default')} "
                      f"{rec.get('error', '')}", flush=True)
            write_json(args.out, doc)
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
