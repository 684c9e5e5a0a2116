"""benchmarks/compile_report.py on a machine without a GPU: the product's expert kernels lowered
for sm_90 by Triton's NVIDIA backend, with their registers, spills and shared buffers; bad input
is a one-line error. Runs in a subprocess: the test process has Triton's interpreter on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compile_report.py"


def _run(*args, interpret=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def _has_ptxas() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return os.path.exists(get_ptxas(90).path)
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this Triton build
        return False


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no NVIDIA backend / ptxas")
def test_every_product_expert_kernel_compiles_for_hopper():
    """The installed Triton (CI's is the newest) still builds each expert kernel at the
    product's Hopper configs, small T (64-row blocks) and large: one that no longer compiles
    would fall back to the pointer path on the GPU."""
    out = _run("all", "--tokens", "1024,8192", "--json")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    docs = [json.loads(line) for line in out.stdout.strip().splitlines()]
    by = {(d["kernel"], d["tokens"]): d for d in docs}
    assert set(by) == {(k, t) for k in ("fc1", "fc2", "dx", "dact", "wgrad_down",
                                        "wgrad_gate_up") for t in (1024, 8192)}
    for doc in docs:
        assert "error" not in doc and 0 < doc["registers"] <= 255, doc
        assert doc["spill_store_bytes"] >= 0 and doc["shared_bytes"] > 0, doc
    # The variants the product picks at 128-row blocks, each seen in what was lowered.
    # FC1 at 128-row blocks: the Triton kernel's [2, BN, BK] gate/up box (the warp-specialized
    # Gluon kernel only under MOEGRAPH_FC1_WS=1: test_the_gluon_fc1_compiles_for_hopper).
    assert by["fc1", 8192]["variant"] == "tma+persistent+pair"
    assert "4x2x128x64 bf16" in by["fc1", 8192]["buffers"], by["fc1", 8192]
    assert by["fc1", 1024]["variant"] == "tma+pair"
    assert "5x2x128x32 bf16" in by["fc1", 1024]["buffers"], by["fc1", 1024]
    assert by["dact", 8192]["variant"] == "pair" and by["dact", 8192]["tile"][:3] == [128, 128, 64]
    assert "3x64x256 bf16" in by["dact", 8192]["buffers"]  # the 2 BN tile
    # dW's long loops: the warp-specialized Gluon kernel (its own buffers: the TMA store tile)
    assert by["wgrad_gate_up", 8192]["variant"] == "tma+persistent+ws+store"
    assert "256x128 bf16" in by["wgrad_gate_up", 8192]["buffers"]
    # FC2 and dX at 128-row blocks: the warp-specialized Gluon kernel at the 3 stages that
    # fit beside its [BM, BN] store buffer; at 64-row blocks the Triton kernel.
    for kernel in ("fc2", "dx"):
        assert by[kernel, 8192]["variant"] == "tma+persistent+ws", by[kernel, 8192]
        assert by[kernel, 8192]["tile"][5] == 3 and "128x256 bf16" in by[kernel, 8192]["buffers"]
        assert "ws" not in by[kernel, 1024]["variant"]
    # The product's launch keywords name the contraction (kernels/fp_fusion.py): Triton 3.9
    # warns of an unset one, and these compiles go through those keywords.
    assert "FP_FUSION" not in out.stderr, out.stderr[-2000:]


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no NVIDIA backend / ptxas")
def test_the_gluon_fc1_compiles_for_hopper():
    """The opt-in warp-specialized FC1 (fc1_swiglu_ws.py) at the product's 128-row tile: 3
    stages of a [2 BN, BK] gate/up buffer beside the two [BM, BN] hand-off buffers (gate and
    up), no spill."""
    out = _run("fc1", "--tokens", "8192", "--spec", "+keep+ws", "--json")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in doc and doc["variant"] == "tma+persistent+ws+pair", doc
    assert doc["spill_store_bytes"] == 0 and doc["tile"][5] == 3, doc
    assert "3x256x64 bf16" in doc["buffers"], doc
    assert doc["buffers"].count("128x128 bf16") == 2, doc


@pytest.mark.parametrize("args,message", [
    (["dact", "--spec", "128x128"], "want bm x bn x bk"),
    (["dact", "--spec", "+tmaa"], "unknown variant part"),
    (["dact", "--tokens", "0"], "each at least 1"),
    (["dact", "--tokens", "8192,x"], "want T[,T...]"),
    (["all", "--spec", "+tma"], "--spec applies to one KERNEL"),
    (["fc3"], "invalid choice"),
])
def test_bad_input_is_a_one_line_error(args, message):
    out = _run(*args)
    assert out.returncode == 2 and message in out.stderr
    assert len([ln for ln in out.stderr.splitlines() if "error" in ln]) == 1


def test_refuses_the_interpreter():
    out = _run("dact", interpret=True)
    assert out.returncode == 1 and "unset TRITON_INTERPRET" in out.stderr
