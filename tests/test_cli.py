"""The command line: help, JSON output, and every bad input as one line plus an exit code."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_util import TINY_SET, run_cli


def _one_line_error(code, out, err, expected_code, needle):
    assert code == expected_code, (code, out, err)
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("moegraph: error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("cmd", ["init", "inspect", "plan", "capture", "profile", "verify"])
def test_every_command_has_help(cmd):
    code, out, _ = run_cli(cmd, "--help")
    assert code == 0 and "--json" in out and "Usage" in out


def test_inspect_profile_json():
    code, out, _ = run_cli("inspect", "--profile", "qwen3-30b-a3b", "--json")
    assert code == 0
    s = json.loads(out)
    assert s["params"]["total"] == 30_532_122_624
    assert s["params"]["active_per_token"] == 3_353_032_704
    assert s["static_memory_bytes"]["weights"] == 2 * s["params"]["total"]
    assert s["static_memory_bytes"]["optimizer"] == 4 * s["params"]["total"]
    assert len(s["layers"]) == 48 and s["layers"][0]["shapes"]["moe.w_gate_up"] == [128, 1536, 2048]


def test_inspect_table_default_profile():
    code, out, _ = run_cli("inspect")
    assert code == 0 and "tiny-qwen3-moe" in out and "static memory" in out


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ck"
    code, out, err = run_cli("init", "tiny-qwen3-moe", d, *TINY_SET)
    assert code == 0, err
    return d


def test_init_then_inspect_checkpoint(ckpt):
    code, out, _ = run_cli("inspect", ckpt, "--json")
    assert code == 0 and json.loads(out)["architecture"]["hidden"] == 32


def _rewrite(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    _one_line_error(*run_cli("inspect", ckpt), 1,
                    "model.layers.1.mlp.experts.3.up_proj.weight is missing from model.safetensors")


def test_unexpected_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.9.mlp.gate.weight", torch.zeros(8, 32)))
    _one_line_error(*run_cli("inspect", ckpt), 1, "model.layers.9.mlp.gate.weight")


def test_wrong_shape(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.experts.7.up_proj.weight",
                                           torch.zeros(16, 31)))
    _one_line_error(*run_cli("inspect", ckpt), 1,
                    "model.layers.0.mlp.experts.7.up_proj.weight in model.safetensors has shape "
                    "[16, 31], config says [16, 32]")


def test_wrong_dtype(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.zeros(32, dtype=torch.int64)))
    _one_line_error(*run_cli("inspect", ckpt), 1, "model.norm.weight")


def test_truncated_file(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    _one_line_error(*run_cli("inspect", ckpt), 1, "model.safetensors")


def test_corrupt_header(ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"!!!!"
    path.write_bytes(bytes(data))
    _one_line_error(*run_cli("inspect", ckpt), 1, "model.safetensors")


def test_bad_config_json(ckpt):
    (ckpt / "config.json").write_text("{ not json")
    _one_line_error(*run_cli("inspect", ckpt), 2, "config.json: invalid JSON")


def test_usage_errors(tmp_path, ckpt):
    _one_line_error(*run_cli("inspect", "--profile", "nope"), 2, "profile 'nope' not found")
    _one_line_error(*run_cli("inspect", "--set", "run.seq_len=abc"), 2,
                    "--set run.seq_len: expected int, got 'abc'")
    _one_line_error(*run_cli("inspect", "--set", "bogus"), 2, "expected section.field=value")
    _one_line_error(*run_cli("inspect", tmp_path / "none"), 2, "not a directory")
    # -c DIR -p PROFILE is allowed (architecture from DIR): tests/test_cli_surface.py
    _one_line_error(*run_cli("init", "tiny-qwen3-moe", ckpt), 2, "exists and is not empty")
    _one_line_error(*run_cli("init", "tiny-qwen3-moe", tmp_path / "x", "--max-shard-size",
                             "lots"), 2, "--max-shard-size 'lots' is not a size")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
@pytest.mark.parametrize("cmd", ["capture", "verify", "profile"])
def test_gpu_commands_exit_4_without_cuda(cmd):
    _one_line_error(*run_cli(cmd), 4, "no CUDA device")
