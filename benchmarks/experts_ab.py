"""Interleaved A/B timing of the expert forward under several kernel configurations.

    python benchmarks/experts_ab.py [--tokens 8192,32768] [--rounds 9] [--out PATH]

Qwen3 shape (E=128, H=2048, F=768, k=8), random routing. For each T and each config
(`default`: the product's tiles; `pointer_store`: FC1 storing Y1 / A through pointers instead
of TMA descriptors; `tail`: the split tail on in FC1 / FC2; `tail_*`: that with another tile
for the tail launch; each config's gather_gemm attributes are patched while its graphs are
captured and its eager calls run), one CUDA graph per measured thing, captured once:
- `forward`: the whole expert forward (route build, FC1 + SwiGLU, FC2, combine);
- `fc1`, `fc2`: the kernel alone on the RouteList of that routing.
Then `--rounds` rounds, each timing every (config, thing) as REPLAYS graph replays back to back
between one pair of CUDA events, the configs' order alternating between rounds, so clock
ramps and drift fall on both alike (device/METHOD.md: a difference smaller than the spread of
one version's repeats is noise). Eager forward throughput (REPLAYS calls back to back) is
timed in the same rounds. Reported: median, min and max ms, and TFLOP/s at the median, with
useful FLOPs only (2 * T * k * H * 3F for the forward; padding rows not counted). The
`plain_gemm` rows, timed in the same rounds, are torch.mm with the same useful FLOPs: the
GPU's GEMM rate in the same power and clock state (sustained load lowers the clocks, so these
figures read lower than isolated launches do).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_experts import (SHAPES, capture_graph, kernel_flops, make_case,  # noqa: E402
                         time_throughput)

from moegraph_cli.train.harness import device_info  # noqa: E402
from moegraph_cli.moe.experts import (build_routes, permute_free_moe_with_drops,  # noqa: E402
                                      tile_configs)
from moegraph_kernels import gather_gemm  # noqa: E402
from moegraph_kernels.gather_gemm import GemmConfig, fc1_swiglu, slot_gemm  # noqa: E402

REPLAYS = 30


def _tail_policy(warps=None, stages=None, persistent=None):
    """A tail_config replacement: the product's, then these fields where given."""
    def policy(cfg, product=gather_gemm.tail_config):
        t = product(cfg)
        return t._replace(num_warps=warps or t.num_warps, num_stages=stages or t.num_stages,
                          persistent=t.persistent if persistent is None else persistent)
    return policy


def _tile(tile):
    """FC1 replaced by `tile` (6 fields) under the default's variant."""
    return lambda fc1: GemmConfig(*tile).with_variant(fc1.variant)


T96 = _tile((128, 64, 64, 8, 8, 3))  # 96 KB of shared memory: two programs per SM
# name: (split tail in FC1 / FC2, gather_gemm attributes patched while the config runs,
#        FC1 tile from the default's, or None for the default's)
CONFIGS = {
    "default": (False, {}, None),
    "pointer_store": (False, {"FC1_TMA_STORE": False}, None),
    "tma_store": (False, {"FC1_TMA_STORE": True}, None),
    "fc1_t96": (False, {"FC1_TMA_STORE": False}, T96),
    "fc1_t96_g4": (False, {"FC1_TMA_STORE": False}, _tile((128, 64, 64, 4, 8, 3))),
    "fc1_t96_tma_store": (False, {"FC1_TMA_STORE": True}, T96),
    "fc1_persistent": (False, {}, lambda fc1: fc1.with_variant("tma+persistent")),
    "fc1_persistent_noflat": (False, {}, lambda fc1: fc1.with_variant("tma+persistent+noflat")),
    "fc1_g1": (False, {}, lambda fc1: fc1._replace(group_m=1)),
    "fc1_g16": (False, {}, lambda fc1: fc1._replace(group_m=16)),
    # FC1 without the paired gate/up box: two [BN, BK] tiles and two dots a K step
    "fc1_unpaired": (False, {}, lambda fc1: fc1._replace(paired=False, persistent=False)),
    "fc1_not_persistent": (False, {}, lambda fc1: fc1._replace(persistent=False)),
    # 96 KB paired tiles (one N = 128 dot): two programs per SM, one's epilogue under the
    # other's K loop
    "fc1_p96": (False, {}, lambda fc1: GemmConfig(128, 64, 64, 8, 8, 3).with_variant("tma+pair")),
    "fc1_p96_w4": (False, {}, lambda fc1: GemmConfig(128, 64, 64, 8, 4, 3).with_variant(
        "tma+pair")),
    "fc1_p96_k32": (False, {}, lambda fc1: GemmConfig(128, 64, 32, 8, 8, 6).with_variant(
        "tma+pair")),
    "fc1_paired_persistent": (False, {}, lambda fc1: fc1.with_variant("tma+persistent+pair")),
    "fc1_paired_k128": (False, {}, _tile((128, 128, 128, 4, 8, 2))),
    "fc1_paired_k32": (False, {}, _tile((128, 128, 32, 4, 8, 7))),
    "fc1_paired_g8": (False, {}, lambda fc1: fc1._replace(group_m=8)),
    "fc1_paired_s3": (False, {}, lambda fc1: fc1._replace(num_stages=3)),
    "tail": (True, {}, None),
    "tail_w8": (True, {"tail_config": _tail_policy(warps=8)}, None),
    "tail_w8_s2": (True, {"tail_config": _tail_policy(warps=8, stages=2)}, None),
    "tail_np_w8_s2": (True, {"tail_config": _tail_policy(warps=8, stages=2,
                                                         persistent=False)}, None),
    "tail_p_w8": (True, {"tail_config": _tail_policy(warps=8, persistent=True)}, None),
}


@contextlib.contextmanager
def patched(attrs):
    before = {name: getattr(gather_gemm, name) for name in attrs}
    for name, value in attrs.items():
        setattr(gather_gemm, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(gather_gemm, name, value)


def configs_for(T, E, H, F_, k, device, names):
    """name -> (TileConfigs, patched attributes); `default` always comes first."""
    base = tile_configs(T * k, E, H, F_, device)
    cfgs = {}
    for name in ["default"] + [n for n in names if n != "default"]:
        tail, attrs, fc1 = CONFIGS[name]
        fc1 = base.fc1 if fc1 is None else fc1(base.fc1)
        cfgs[name] = (base._replace(fc1=fc1._replace(split_tail=tail),
                                    fc2=base.fc2._replace(split_tail=tail)), attrs)
    return cfgs


def _under(attrs, fn):
    def run():
        with patched(attrs):
            return fn()
    return run


PLAIN = "plain_gemm"


def plain_gemm_steps(rows, H, F_, dtype):
    """The ceiling in the same rounds: plain bf16 GEMMs with FC1's and FC2's useful FLOPs
    (N = T*k rows, no gather, no padding, no epilogue), as `plain_gemm` fc1 / fc2 / forward."""
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    a1 = torch.randn(rows, H, device=dev, generator=gen).to(dtype)
    b1 = (torch.randn(H, 2 * F_, device=dev, generator=gen) * 0.02).to(dtype)
    a2 = torch.randn(rows, F_, device=dev, generator=gen).to(dtype)
    b2 = (torch.randn(F_, H, device=dev, generator=gen) * 0.02).to(dtype)
    o1 = torch.empty(rows, 2 * F_, device=dev, dtype=dtype)
    o2 = torch.empty(rows, H, device=dev, dtype=dtype)

    def both():
        torch.mm(a1, b1, out=o1)
        torch.mm(a2, b2, out=o2)
    return {(PLAIN, "fc1"): capture_graph(lambda: torch.mm(a1, b1, out=o1)).replay,
            (PLAIN, "fc2"): capture_graph(lambda: torch.mm(a2, b2, out=o2)).replay,
            (PLAIN, "forward"): capture_graph(both).replay, (PLAIN, "eager_forward"): both}


def measure(T, rounds, names):
    E, H, F_, k = SHAPES["qwen3"]
    dev = torch.device("cuda")
    x, ids, w, wgu, wd, _ = make_case(E, H, F_, k, T)
    cfgs = configs_for(T, E, H, F_, k, dev, names)
    routes = build_routes(ids, w.detach(), E, cfgs["default"][0].route_block, None)
    w_N = w.detach().reshape(-1).contiguous()
    S = routes.num_slots
    y1 = torch.empty(S, 2 * F_, device=dev, dtype=x.dtype)
    act = torch.empty(S, F_, device=dev, dtype=x.dtype)
    y2 = torch.empty(S, H, device=dev, dtype=x.dtype)
    xd, wgud, wdd = x.detach(), wgu.detach(), wd.detach()
    steps = {}
    for name, (c, attrs) in cfgs.items():
        fwd = _under(attrs, lambda c=c: permute_free_moe_with_drops(x, ids, w, wgu, wd, None, c))
        steps[(name, "forward")] = capture_graph(fwd).replay
        steps[(name, "eager_forward")] = fwd
        steps[(name, "fc1")] = capture_graph(_under(
            attrs, lambda c=c: fc1_swiglu(xd, wgud, w_N, routes, y1, act, c.fc1))).replay
        steps[(name, "fc2")] = capture_graph(_under(
            attrs, lambda c=c: slot_gemm(act, wdd, routes, y2, True, c.fc2))).replay
    steps.update(plain_gemm_steps(T * k, H, F_, x.dtype))
    for step in steps.values():  # warm every path once more
        step()
    torch.cuda.synchronize()
    samples = {key: [] for key in steps}
    names = list(cfgs) + [PLAIN]
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for thing in ("forward", "eager_forward", "fc1", "fc2"):
                if (name, thing) in steps:
                    samples[(name, thing)].append(
                        time_throughput(steps[(name, thing)], REPLAYS, warmup=0))
    flops = {"forward": 2 * T * k * H * 3 * F_, "eager_forward": 2 * T * k * H * 3 * F_,
             "fc1": kernel_flops("fc1", E, H, F_, k, T), "fc2": kernel_flops("fc2", E, H, F_, k, T)}
    counts = routes.expert_counts.long()
    rem = counts % routes.block_m
    padded = int((counts + routes.block_m - 1).div(routes.block_m, rounding_mode="floor").sum()
                 * routes.block_m)
    short = (rem > 0) & (rem <= routes.block_m // 2)
    records = []
    for (name, thing), ms in samples.items():
        med = statistics.median(ms)
        records.append(dict(T=T, config=name, what=thing, median_ms=med, min_ms=min(ms),
                            max_ms=max(ms), samples_ms=ms, tflops=flops[thing] / med / 1e9,
                            rounds=rounds, replays=REPLAYS, route_block=routes.block_m,
                            routes=T * k, padded_slots=padded,
                            short_tail_experts=int(short.sum()),
                            short_tail_padding_rows=int((routes.block_m - rem[short]).sum()),
                            **_config_fields(cfgs.get(name)),
                            **device_info()))
    return records


def _config_fields(cfg_attrs) -> dict:
    if cfg_attrs is None:  # the plain GEMMs
        return dict(fc1="torch.mm [N, H] x [H, 2F]", fc2="torch.mm [N, F] x [F, H]")
    return dict(fc1=repr(cfg_attrs[0].fc1), fc2=repr(cfg_attrs[0].fc2),
                patched={a: v for a, v in cfg_attrs[1].items() if not callable(v)},
                fc1_tail=_tail_repr(cfg_attrs, "fc1"), fc2_tail=_tail_repr(cfg_attrs, "fc2"))


def _tail_repr(cfg_attrs, kernel):
    cfg, attrs = cfg_attrs
    tile = getattr(cfg, kernel)
    if not tile.split_tail:
        return None
    with patched(attrs):
        return repr(gather_gemm.tail_config(tile))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"configs beside the default, of {', '.join(CONFIGS)}")
    ap.add_argument("--out", default="/tmp/experts_ab.json")
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = set(names) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown config {sorted(unknown)[0]!r}")
    records = []
    for T in (int(t) for t in args.tokens.split(",")):
        records += measure(T, args.rounds, names)
        Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
    print(f"{'T':>6} {'what':14} {'config':14} {'median ms':>10} {'min':>8} {'max':>8} "
          f"{'TFLOP/s':>8}")
    for r in sorted(records, key=lambda r: (r["T"], r["what"], r["median_ms"])):
        print(f"{r['T']:6d} {r['what']:14} {r['config']:14} {r['median_ms']:10.4f} "
              f"{r['min_ms']:8.4f} {r['max_ms']:8.4f} {r['tflops']:8.1f}")


if __name__ == "__main__":
    main()
