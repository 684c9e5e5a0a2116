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


def test_capture_refuses_a_non_finite_checkpoint_weight_on_cuda(tmp_path):
    """The load's check on the GPU: `capture -c` of a checkpoint with one NaN weight is exit 1,
    one line naming the tensor, before any step runs."""
    from safetensors.torch import load_file, save_file

    from cli_util import one_line, run_cli

    d = tmp_path / "ck"
    code, _, err = run_cli("init", "tiny-qwen3-moe", d)
    assert code == 0, err
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors = load_file(d / "model.safetensors")
    tensors[name][4, 1] = float("nan")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    one_line(*run_cli("capture", "-c", d, "--steps", "1", "--warmup", "1"), 1,
             f"checkpoint: tensor {name} in model.safetensors is not finite (nan at [4, 1])")
