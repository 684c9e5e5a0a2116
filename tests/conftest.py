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

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Without CUDA, the `cuda` tests skip. With it, they share one xdist group, so that under
    the README's `-n 2 --dist loadgroup` they run one at a time in one worker (their memory and
    timing figures assume the GPU to themselves)."""
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("cuda") if HAS_CUDA else skip)
