"""What an expert kernel compiles to on a Hopper GPU, asked on any machine: Triton's NVIDIA
backend lowers it for sm_90 without a GPU, ptxas reports its registers and spills, and the
TTGIR its shared-memory buffers (how deep the pipeline is). A tile or variant can be judged
this far before any device time is spent on it, a pipeliner failure shows up as its error, and
a Triton release that can no longer build one of the product's kernels for Hopper (where the
launcher would warn and fall back to the pointer path) is seen without a GPU.

    python3 benchmarks/compile_report.py KERNEL [--spec SPEC ...] [--tokens 8192[,T...]]
        [--json] [--out PATH]

KERNEL: fc1, fc2, dx, dact, wgrad_down, wgrad_gate_up, or `all` (each of them at the
product's config), at the Qwen3 expert shape (E = 128, k = 8, H = 2048, F = 768, bf16). SPEC
is tiles_ab.py's spelling of a config, applied to the product's own for that T
(moe/experts.tile_configs): `128x128x64x8x8x3` (a tile), `+tma+persistent` (a variant) or
both; the launcher's rules then pick the constexprs (FC1's paired box, dact's paired tile,
dW's padded loop, its TMA operands and store), as on a Hopper GPU. Each line (or the --json
document) gives the Triton version, shared memory, registers a thread, spill bytes (stores,
from ptxas -v) and the shared buffers as shape x dtype; --spec repeats (an empty one is the
product's), --tokens takes a list, and --out writes every record into one results document
(common.environment: no GPU, the torch and Triton versions, the commit, the date). The
compile takes the product's launch keywords (GemmConfig.launch_options). Needs the Triton
wheel's NVIDIA backend (ptxas), no GPU. Exit 1 when any config fails to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

E, TOP_K, H, F = 128, 8, 2048, 768
KERNELS = ("fc1", "fc2", "dx", "dact", "wgrad_down", "wgrad_gate_up")
ROUTE_PTRS = ("slot_token_ptr", "slot_route_ptr", "block_expert_ptr", "live_list_ptr",
              "expert_counts_ptr", "expert_starts_ptr", "expert_start_ptr",
              "expert_count_ptr")


def product_config(kernel: str, tokens: int):
    import torch
    from moegraph_cli.moe.experts import tile_configs
    cfgs = tile_configs(tokens * TOP_K, E, H, F, torch.device("cuda"))
    return cfgs, getattr(cfgs, kernel)


def fc1_source(cfg, route_block: int):
    """(ASTSource, cfg) of fc1_swiglu's launch under cfg (fc1_swiglu._fc1_swiglu's rules on a
    Hopper GPU: TMA weights, as one [2, BN, BK] gate/up box where paired and 2 BN <= 256;
    Y1 and A by TMA stores only under MOEGRAPH_FC1_TMA_STORE)."""
    from moegraph_kernels import gemm_config as gc
    from moegraph_kernels.fc1_swiglu import _fc1_swiglu_kernel as fn
    if cfg.warp_specialize and cfg.block_m == route_block == 128 and F % cfg.block_n == 0 \
            and H % cfg.block_k == 0:
        return fc1_ws_source(cfg)
    paired = cfg.tma and cfg.paired and 2 * cfg.block_n <= 256
    y_tma = gc.FC1_TMA_STORE and cfg.tma and F % cfg.block_n == 0
    consts = dict(ROUTE_BLOCK=route_block, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=H % cfg.block_k == 0,
                  EVEN_N=F % cfg.block_n == 0, HAS_BIAS=False, CLAMPED=False, TAIL=0,
                  Y_TMA=y_tma, PAIRED=paired, FAST_ACT=cfg.fast_act, **_meta(cfg))
    box = (f"tensordesc<bf16[2, {cfg.block_n}, {cfg.block_k}]>" if paired else
           f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>")
    store = f"tensordesc<bf16[{cfg.block_m}, {cfg.block_n}]>" if y_tma else "*bf16"
    types = {"alpha": "fp32", "limit": "fp32", "w_desc": box if cfg.tma else "*bf16",
             "y1_desc": store, "act_desc": store}
    return _source(fn, consts, types, odd=("num_experts",)), cfg


def fc1_ws_source(cfg):
    """fc1_swiglu_ws.py's warp-specialized kernel (fc1_swiglu's choice on a Hopper GPU where
    cfg asks for warp_specialize and the launch fits), at the stages that fit."""
    from moegraph_kernels import fc1_swiglu_ws as ws
    return _ws_source(ws, ws._fc1_swiglu_ws_kernel, cfg, {}, {
        "w_desc": _gluon_desc((cfg.block_n, cfg.block_k)),
        "y1_desc": _gluon_desc((cfg.block_m, cfg.block_n)),
        "act_desc": _gluon_desc((cfg.block_m, cfg.block_n))})


def _ws_source(module, fn, cfg, consts: dict, types: dict):
    """(ASTSource, the config it runs) of a warp-specialized Gluon kernel of `module` under
    cfg, with the constexprs its launch passes (module.launch_constants)."""
    consts = dict(consts, **module.launch_constants(cfg.block_m, cfg.block_n, cfg.block_k,
                                                     cfg.group_m, cfg.num_stages))
    return (_source(fn, consts, types, odd=("num_experts", "num_blocks", "num_tokens",
                                            "num_routes")),
            cfg._replace(num_warps=consts["num_warps"], num_stages=consts["STAGES"]))


def slot_gemm_source(cfg, route_block: int, w_nk: bool):
    """The same for slot_gemm: FC2 (w_nk: A [S, F] @ w_down [E, H, F]^T) or dX (dY1 [S, 2F]
    @ w_gate_up [E, 2F, H]); TMA for both operands where the K rule allows it."""
    from moegraph_kernels.slot_gemm import _slot_gemm_kernel as fn
    n, k = (H, F) if w_nk else (H, 2 * F)
    if cfg.warp_specialize and cfg.block_m == route_block == 128 and n % cfg.block_n == 0 \
            and k % cfg.block_k == 0:
        return slot_gemm_ws_source(cfg, w_nk)
    use_tma = cfg.tma and (w_nk or k % cfg.block_k == 0)
    consts = dict(W_NK=w_nk, ROUTE_BLOCK=route_block, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
                  WARP_SPECIALIZE=False, HAS_BIAS=False, TAIL=0,
                  **_meta(cfg._replace(tma=use_tma)))
    w_box = [cfg.block_n, cfg.block_k] if w_nk else [cfg.block_k, cfg.block_n]
    types = {"a_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>" if use_tma
             else "*bf16",
             "w_desc": f"tensordesc<bf16[{w_box[0]}, {w_box[1]}]>" if use_tma else "*bf16"}
    return _source(fn, consts, types, odd=("num_experts",)), cfg


def slot_gemm_ws_source(cfg, w_nk: bool):
    """slot_gemm_ws.py's warp-specialized kernel (slot_gemm's choice on a Hopper GPU where
    cfg asks for warp_specialize and the launch fits), at the stages that fit."""
    from moegraph_kernels import slot_gemm_ws as ws
    w_box = (cfg.block_n, cfg.block_k) if w_nk else (cfg.block_k, cfg.block_n)
    return _ws_source(ws, ws._slot_gemm_ws_kernel, cfg, {"W_NK": w_nk}, {
        "a_desc": _gluon_desc((cfg.block_m, cfg.block_k)), "w_desc": _gluon_desc(w_box),
        "c_desc": _gluon_desc((cfg.block_m, cfg.block_n))})


def _meta(cfg) -> dict:
    """gemm_launch.build_plan's variant constexprs on a Hopper GPU (warp specialization
    off: gemm_config.WARP_SPECIALIZE_ENABLED)."""
    return dict(USE_TMA=cfg.tma, PERSISTENT=cfg.persistent,
                FLATTEN=cfg.persistent and cfg.flatten, LIST_CHUNK=1024)


def dact_source(cfg, route_block: int):
    """(ASTSource, warps, stages) of dact_swiglu's launch under cfg (dact_swiglu._dact_swiglu's
    rules: the paired tile 2 BN wide; TMA weights where H divides by BK)."""
    from moegraph_kernels.dact_swiglu import _dact_swiglu_kernel as fn
    from moegraph_kernels.dact_swiglu import paired_tile
    paired = paired_tile(F, cfg)
    bn = 2 * cfg.block_n if paired else cfg.block_n
    use_tma = cfg.tma and H % cfg.block_k == 0
    consts = dict(ROUTE_BLOCK=route_block, BLOCK_M=cfg.block_m, BLOCK_N=bn,
                  BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=H % cfg.block_k == 0,
                  EVEN_N=F % bn == 0, USE_TMA=use_tma, PERSISTENT=cfg.persistent,
                  FLATTEN=cfg.persistent and cfg.flatten, LIST_CHUNK=1024, CLAMPED=False,
                  TAIL=0, PAIRED=paired, FAST_ACT=cfg.fast_act)
    types = {"dp_ptr": "*fp32", "alpha": "fp32", "limit": "fp32",
             "w_desc": f"tensordesc<bf16[{cfg.block_k}, {bn}]>" if use_tma else "*bf16"}
    return _source(fn, consts, types, odd=("num_experts",)), cfg


def wgrad_source(cfg, down: bool, route_block: int):
    """The same for expert_wgrad (wgrad.expert_wgrad's rules: the padded loop where BK divides
    the route block, the slot-order operand by TMA, the tile by a TMA store)."""
    from moegraph_kernels.wgrad import _expert_wgrad_kernel as fn
    padded = route_block % cfg.block_k == 0
    if cfg.warp_specialize and padded:
        return wgrad_ws_source(cfg, down)
    l_tma = padded and cfg.tma and not down
    r_tma = padded and cfg.tma and down
    consts = dict(GATHER_L=down, GATHER_R=not down, ACCUMULATE=False, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  PADDED=padded, L_TMA=l_tma, R_TMA=r_tma, OUT_TMA=cfg.store_tma,
                  PERSISTENT=cfg.persistent)
    types = {"l_desc": f"tensordesc<bf16[{cfg.block_k}, {cfg.block_m}]>" if l_tma else "*bf16",
             "r_desc": f"tensordesc<bf16[{cfg.block_k}, {cfg.block_n}]>" if r_tma else "*bf16",
             "dw_desc": (f"tensordesc<bf16[{cfg.block_m}, {cfg.block_n}]>" if cfg.store_tma
                         else "*bf16")}
    return _source(fn, consts, types), cfg


def wgrad_ws_source(cfg, down: bool):
    """wgrad_ws.py's warp-specialized kernel (expert_wgrad's choice on a Hopper GPU where cfg
    asks for warp_specialize): the slot-order operand's TMA box, the TMA store."""
    from moegraph_kernels import wgrad_ws as ws
    fn = ws._wgrad_ws_kernel
    consts = dict(GATHER_L=down, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m, STAGES=cfg.num_stages, PRODUCER_WARPS=ws.PRODUCER_WARPS,
                  PRODUCER_REGS=ws.PRODUCER_REGS, num_warps=ws.CONSUMER_WARPS)
    s_box = (cfg.block_k, cfg.block_n) if down else (cfg.block_k, cfg.block_m)
    types = {"s_desc": _gluon_desc(s_box), "g_ptr": "*bf16",
             "dw_desc": _gluon_desc((cfg.block_m, cfg.block_n))}
    return _source(fn, consts, types), cfg._replace(num_warps=ws.CONSUMER_WARPS)


def _gluon_desc(box) -> str:
    """A Gluon tensor descriptor's signature type: bf16 boxes in the default NVMMA layout."""
    from triton.experimental.gluon import language as gl
    layout = gl.NVMMASharedLayout.get_default_for(list(box), gl.bfloat16)
    return f"tensordesc<bf16[{box[0]}, {box[1]}],{layout!r}>"


def _source(fn, consts: dict, types: dict, odd=()):
    """An ASTSource over fn's arguments: pointers bf16 (route lists int32) unless `types`
    says otherwise, other scalars int32; every pointer and int (but `odd`) 16-divisible, as
    the launch's own specialization would find them."""
    from triton.compiler import ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name) or ("*i32" if name in ROUTE_PTRS else
                                        "*bf16" if name.endswith("_ptr") else "i32")
        if sig[name] in ("*bf16", "*i32", "*fp32", "i32") and name not in odd:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                          for k, v in consts.items()}, attrs=attrs)


def kernel_source(kernel: str, cfg, route_block: int):
    """(ASTSource, the config the launch runs) of KERNEL under cfg."""
    if kernel == "fc1":
        return fc1_source(cfg, route_block)
    if kernel in ("fc2", "dx"):
        return slot_gemm_source(cfg, route_block, kernel == "fc2")
    if kernel == "dact":
        return dact_source(cfg, route_block)
    return wgrad_source(cfg, kernel == "wgrad_down", route_block)


def report(src, cfg) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    out = {"triton": triton.__version__, "arch": "sm_90a", "tile": list(cfg[:6]),
           "variant": cfg.variant}
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=cfg.launch_options())  # the product's launch keywords
    except Exception as exc:  # noqa: BLE001 - a config that does not compile: its first line
        lines = [ln for ln in str(exc).splitlines() if "error:" in ln] or str(exc).splitlines()
        return {**out, "error": f"{type(exc).__name__}: {lines[0].strip()[:300] if lines else ''}"}
    out["shared_bytes"] = k.metadata.shared
    out["buffers"] = [f"{shape} {dtype}" for shape, dtype in re.findall(
        r"ttg\.local_alloc[^:\n]*: \(\) -> !ttg\.memdesc<([0-9x]+)x(\w+)", k.asm["ttgir"])]
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path  # the one Triton itself assembles sm_90 with
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"compile_report_{os.getpid()}.ptx")
    with open(path, "w") as fh:
        fh.write(k.asm["ptx"])
    try:
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                              capture_output=True, text=True, check=False).stderr
    finally:
        os.unlink(path)
    regs = re.findall(r"Used (\d+) registers", info)
    spills = re.findall(r"(\d+) bytes spill stores", info)
    out["registers"] = int(regs[-1]) if regs else None
    out["spill_store_bytes"] = int(spills[-1]) if spills else None
    return out


def _tokens(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want T[,T...], each at least 1")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=(*KERNELS, "all"))
    ap.add_argument("--spec", action="append", default=None,
                    help="tiles_ab.py's SPEC (repeatable; '' or none: the product's)")
    ap.add_argument("--tokens", type=_tokens, default=[8192],
                    help="T[,T...], each setting the product's tiles (default 8192)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="write the records into one JSON document")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("benchmarks/compile_report.py: unset TRITON_INTERPRET (it compiles for a GPU)")
    kernels = KERNELS if args.kernel == "all" else (args.kernel,)
    if args.kernel == "all" and any(args.spec or []):
        ap.error("--spec applies to one KERNEL, not all")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import environment, write_json
    from tiles_ab import parse_spec
    jobs = []
    for tokens in args.tokens:
        for kernel in kernels:
            cfgs, product = product_config(kernel, tokens)
            try:
                jobs += [(kernel, tokens, cfgs.route_block, spec,
                          parse_spec(spec, product) if spec else product)
                         for spec in args.spec or [""]]
            except ValueError as exc:
                ap.error(str(exc))
    records = []
    for kernel, tokens, route_block, spec, cfg in jobs:
        src, cfg = kernel_source(kernel, cfg, route_block)
        rec = {"kernel": kernel, "tokens": tokens, "spec": spec, **report(src, cfg)}
        records.append(rec)
        print(json.dumps(rec) if args.json else " ".join(f"{k}={v}" for k, v in rec.items()),
              flush=True)
    if args.out:  # the Triton imported (PYTHONPATH may hold another than the installed one)
        import triton
        write_json(args.out, {"benchmark": "compile_report", **environment(device=False),
                              "triton": triton.__version__, "records": records})
    sys.exit(1 if any("error" in r for r in records) else 0)


if __name__ == "__main__":
    main()
