"""benchmarks/compile_report.py on a machine without a GPU: dA's product tile lowered for
sm_90 by Triton's NVIDIA backend, with its registers, spills and shared buffers; bad input is a
one-line error. Runs in a subprocess: the test process has Triton's interpreter on."""

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
def test_dact_product_tile_compiles_for_hopper():
    out = _run("dact", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["kernel"] == "dact" and doc["variant"] == "pair" and "error" not in doc
    assert doc["tile"] == [128, 128, 64, 8, 8, 3]
    assert 0 < doc["registers"] <= 255 and doc["spill_store_bytes"] >= 0
    assert doc["shared_bytes"] > 0 and "3x64x256 bf16" in doc["buffers"]  # the 2 BN tile


@pytest.mark.parametrize("args,message", [
    (["dact", "--spec", "128x128"], "want bm x bn x bk"),
    (["dact", "--spec", "+tmaa"], "unknown variant part"),
    (["dact", "--tokens", "0"], "--tokens must be at least 1"),
    (["fc3"], "invalid choice"),
])
def test_bad_input_is_a_one_line_error(args, message):
    out = _run(*args)
    assert out.returncode == 2 and message in out.stderr
    assert len([ln for ln in out.stderr.splitlines() if "error" in ln]) == 1


def test_refuses_the_interpreter():
    out = _run("dact", interpret=True)
    assert out.returncode == 1 and "unset TRITON_INTERPRET" in out.stderr
