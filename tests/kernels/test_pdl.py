"""kernels/pdl.py: programmatic dependent launch is asked for by MOEGRAPH_PDL=1 and taken
only on a CUDA sm_90+ device outside Triton's interpreter; the launch keywords follow."""

import os
import subprocess
import sys

import torch

from moegraph_kernels import pdl


def test_never_on_the_cpu_or_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(pdl, "REQUESTED", True)
    assert not pdl.mode(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.mode(torch.device("cuda", 0))


def test_off_unless_asked_for(monkeypatch):
    monkeypatch.setattr(pdl, "REQUESTED", False)
    assert not pdl.mode(torch.device("cuda", 0))
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}


def test_the_environment_variable_is_read_and_checked():
    code = "from moegraph_kernels import pdl; print(pdl.REQUESTED)"
    for value, want in (("1", "True"), ("0", "False"), ("", "False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**_env(), "MOEGRAPH_PDL": value})
        assert out.returncode == 0 and out.stdout.strip() == want, out.stderr[-500:]
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**_env(), "MOEGRAPH_PDL": "yes"})
    assert bad.returncode != 0 and "MOEGRAPH_PDL='yes': expected 0 or 1" in bad.stderr


def _env():
    return {k: v for k, v in os.environ.items() if k != "MOEGRAPH_PDL"}
