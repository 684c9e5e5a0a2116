"""The non-finite scan on the GPU: aminmax's NaN and infinity propagation in every float dtype
a checkpoint loads in, on a big tensor (several reduction blocks) and a one-element one."""

import pytest
import torch

from moegraph_cli.models.common.finite import first_non_finite

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_scan_finds_the_bad_value_on_cuda(dtype, bad):
    clean = torch.randn(1 << 20, device="cuda").to(dtype)
    poisoned = torch.randn(3, 1 << 18, device="cuda").to(dtype)
    poisoned[2, 12345] = bad
    one = torch.full((1,), bad, device="cuda", dtype=dtype)
    assert first_non_finite([("clean", clean)]) is None
    name, what = first_non_finite([("clean", clean), ("poisoned", poisoned), ("one", one)])
    assert name == "poisoned" and what.endswith("at [2, 12345]"), what
    assert first_non_finite([("clean", clean), ("one", one)])[0] == "one"
