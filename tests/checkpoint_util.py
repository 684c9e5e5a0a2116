"""Shared by the checkpoint tests (test_checkpoint.py, test_checkpoint_errors.py): a tiny
config, random state dicts, bitwise comparison, raw safetensors files, and one-file and sharded
checkpoints as fixtures."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moegraph_cli.config import ModelConfig
from moegraph_cli.io.checkpoint_save import save_checkpoint
from moegraph_cli.io.hf_names import INDEX_FILE, moegraph_shapes


def tiny_cfg(**overrides) -> ModelConfig:
    """3 layers, layer 1 dense (mlp_only_layers), 4 experts; H=32, F=16, I=48, hd=8."""
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    fields.update(overrides)
    return ModelConfig(**fields).validate()


CONFIG_SUMMARY = ("3 layers, 4 experts, mlp_only_layers [1], decoder_sparse_step 1, "
                  "tie_word_embeddings false")


def random_state_dict(cfg: ModelConfig, dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    """Random weights, with the values a lossy path would mangle in the embedding."""
    gen = torch.Generator().manual_seed(seed)
    sd = {name: torch.randn(shape, generator=gen).to(dtype)
          for name, shape in moegraph_shapes(cfg).items()}
    tricky = torch.tensor([-0.0, float("inf"), -float("inf"), float("nan"),
                           torch.finfo(dtype).tiny / 4, torch.finfo(dtype).max])
    sd["embed_tokens.weight"][0, :len(tricky)] = tricky.to(dtype)
    return sd


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bit_identical(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert torch.equal(bits(got[name]), bits(want[name])), name


def read_all(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(file, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def header_of(file: Path) -> dict:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def raw_safetensors(file: Path, header: dict, data: bytes) -> None:
    """A hand-made file, for headers the safetensors writer would refuse to produce."""
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def message(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


@pytest.fixture
def single(tmp_path):
    """A one-file fp32 checkpoint of tiny_cfg() and its state dict."""
    cfg, sd = tiny_cfg(), random_state_dict(tiny_cfg())
    save_checkpoint(sd, cfg, tmp_path / "ck")
    return tmp_path / "ck", cfg, sd


@pytest.fixture
def sharded(tmp_path):
    """A sharded fp32 checkpoint of tiny_cfg(), its state dict and weight_map."""
    cfg, sd = tiny_cfg(), random_state_dict(tiny_cfg())
    save_checkpoint(sd, cfg, tmp_path / "ck", max_shard_bytes=8192)
    weight_map = json.loads((tmp_path / "ck" / INDEX_FILE).read_text())["weight_map"]
    return tmp_path / "ck", cfg, sd, weight_map
