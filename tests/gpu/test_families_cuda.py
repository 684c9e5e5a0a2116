"""Every family on the GPU: verify --lr0 bitwise with attn+moe graphs over the permute-free
experts, dropless and capacity; capture with no fallback; logits parity with transformers."""

import pytest

from moegraph_cli.commands.capture import capture_command
from moegraph_cli.train.runspec import resolve
from moegraph_cli.commands.verify import verify_command

pytestmark = pytest.mark.cuda

FAMILIES = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe", "tiny-deepseek-v3",
            "tiny-gpt-oss"]
VARIANTS = {"tiny-mixtral": ["model.sliding_window=128"], "tiny-olmoe": ["model.clip_qkv=2.0"],
            "tiny-qwen2-moe": ["model.mlp_only_layers=[0]"], "tiny-qwen3-moe": [],
            "tiny-deepseek-v3": [], "tiny-gpt-oss": []}


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
@pytest.mark.parametrize("profile", FAMILIES)
def test_verify_lr0_bitwise(profile, mode):
    spec = resolve(profile, None, [f"moe.mode={mode}", *VARIANTS[profile]])
    r = verify_command(spec, lr0=True, steps=3, progress=False)
    n = spec.profile.model.num_hidden_layers
    assert r["counters"]["captured"] == 2 * n and r["counters"]["fallback"] == 0
    assert r["bitwise_equal"] and r["passed"], r["verdict"]


@pytest.mark.parametrize("profile", FAMILIES)
def test_capture_replays_without_fallback(profile):
    r = capture_command(resolve(profile, None, VARIANTS[profile]), steps=5, warmup=2,
                        progress=False)
    assert r["captured_ok"] and r["failure"] is None
    assert r["counters"]["fallback"] == 0 and r["counters"]["replayed"] > 0


@pytest.mark.parametrize("profile", FAMILIES)
def test_reference_transformers_parity(profile):
    pytest.importorskip("transformers")
    r = verify_command(resolve(profile, None, VARIANTS[profile]), lr0=True, steps=2,
                       progress=False, reference="transformers")
    assert r["passed"], r["verdict"]
