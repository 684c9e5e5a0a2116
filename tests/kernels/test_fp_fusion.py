"""Every kernel launch names its fp contraction (kernels/fp_fusion.py), so its bits do not hang on
the installed Triton's default (on up to 3.9, which warns when it is unset; off from 3.10)."""

import ast
from pathlib import Path

import pytest

from moegraph_kernels.fp_fusion import FUSED
from moegraph_kernels.gemm_config import GemmConfig

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
# Kernels whose launches turn contraction off: they match torch's op-by-op rounding.
UNFUSED = {"_adamw_kernel", "_dw_reduce_kernel", "_rmsnorm_fwd_kernel", "_rmsnorm_bwd_kernel",
           "_rope_fwd_kernel", "_rope_bwd_kernel"}


def _jit_names(tree: ast.Module) -> set[str]:
    def is_jit(dec):
        target = dec.func if isinstance(dec, ast.Call) else dec
        return isinstance(target, ast.Attribute) and target.attr == "jit"
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any(is_jit(d) for d in node.decorator_list)}


def _launches():
    """(file, kernel, call) for each `kernel[grid](...)` of a @triton.jit kernel in kernels/."""
    out = []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        jit = _jit_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in jit):
                out.append((path.name, node.func.value.id, node))
    return out


def _fusion_of(call: ast.Call):
    """The launch's enable_fp_fusion: a literal bool, 'FUSED', 'launch_options' (a GemmConfig's
    keywords spread into the call) or None when the launch leaves it to Triton."""
    for kw in call.keywords:
        if kw.arg == "enable_fp_fusion":
            if isinstance(kw.value, ast.Constant):
                return kw.value.value
            if isinstance(kw.value, ast.Name):
                return kw.value.id
            return ast.unparse(kw.value)
    for kw in call.keywords:
        if kw.arg is None and isinstance(kw.value, ast.Call) \
                and isinstance(kw.value.func, ast.Attribute) \
                and kw.value.func.attr == "launch_options":
            return "launch_options"
    return None


def test_the_scan_sees_every_kernel_family():
    names = {name for _, name, _ in _launches()}
    # The scan must find the expert GEMMs, the loss, routing and the elementwise kernels, or
    # a change in how launches are written would let it pass on nothing.
    assert {"_fc1_swiglu_kernel", "_slot_gemm_kernel", "_dact_swiglu_kernel",
            "_expert_wgrad_kernel", "_ce_bwd_kernel", "_place_routes_kernel",
            "_adamw_kernel", "_rmsnorm_fwd_kernel"} <= names
    assert len(names) >= 20


@pytest.mark.parametrize("path,name,call", _launches(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_launch_names_its_contraction(path, name, call):
    got = _fusion_of(call)
    where = f"{path}:{call.lineno} {name}"
    assert got is not None, f"{where} leaves enable_fp_fusion to Triton's default"
    if name in UNFUSED:
        assert got is False, f"{where}: torch's rounding needs enable_fp_fusion=False"
    else:
        assert got in ("FUSED", "launch_options"), f"{where}: enable_fp_fusion={got!r}"


def test_gemm_launch_options_carry_it():
    assert FUSED is True  # Triton 3.6's default, under which the GPU results were measured
    for cfg in (GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(64, 256, 32, 4, 4, 5, maxnreg=128)):
        assert cfg.launch_options()["enable_fp_fusion"] is FUSED
