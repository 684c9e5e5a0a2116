"""Test set-up shared by every test file.

Without CUDA, Triton kernels run in its interpreter, which must be switched on before the
first `import triton`; conftest.py is imported before any test module, so it is done here.
Tests marked `cuda` skip cleanly on such machines.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under `-n N` the workers share the machine's cores: each takes its share of threads (and the
# processes it starts inherit it), as torchrun's OMP_NUM_THREADS=1 does for ranks. With every
# worker's torch on every core, two workers on two cores ran their CPU tests about 15% slower.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    from machine_util import usable_cores

    _THREADS = max(1, usable_cores() // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Without CUDA, the `cuda` tests skip. With it, they share one xdist group, so that under
    the README's `-n 2 --dist loadgroup` they run one at a time in one worker (their memory and
    timing figures assume the GPU to themselves)."""
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("cuda") if HAS_CUDA else skip)
