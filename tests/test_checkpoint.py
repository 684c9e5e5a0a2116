"""Checkpoint I/O: round trips are bit-identical, and transformers' checkpoints load (and ours
load in transformers). Bad checkpoints: test_checkpoint_errors.py."""

from __future__ import annotations

import collections
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import moegraph_cli.io.checkpoint as ckpt
from checkpoint_util import (assert_bit_identical, header_of, message, random_state_dict, read_all,
                             sharded, single, tiny_cfg)
from moegraph_cli.config import ModelConfig, read_hf_config
from moegraph_cli.errors import CheckpointError
from moegraph_cli.io.checkpoint import load_state_dict, plan_load
from moegraph_cli.io.checkpoint_save import save_checkpoint
from moegraph_cli.io.hf_names import (INDEX_FILE, SINGLE_FILE, hf_to_moegraph_names,
                                      moegraph_shapes)
from moegraph_cli.models.common.keys import Slot


# -- the name table ---------------------------------------------------------------------------


def test_moegraph_shapes_for_a_tiny_config():
    shapes = moegraph_shapes(tiny_cfg())
    assert shapes["embed_tokens.weight"] == (64, 32)
    assert shapes["layers.0.attn.q_proj.weight"] == (32, 32)
    assert shapes["layers.0.attn.k_proj.weight"] == (16, 32)
    assert shapes["layers.0.attn.o_proj.weight"] == (32, 32)
    assert shapes["layers.0.attn.q_norm.weight"] == (8,)
    assert shapes["layers.0.moe.router.weight"] == (4, 32)
    assert shapes["layers.0.moe.w_gate_up"] == (4, 32, 32)
    assert shapes["layers.0.moe.w_down"] == (4, 32, 16)
    assert shapes["layers.1.mlp.gate_proj.weight"] == (48, 32)
    assert shapes["layers.1.mlp.down_proj.weight"] == (32, 48)
    assert "layers.1.moe.w_gate_up" not in shapes and "layers.0.mlp.post_norm.weight" not in shapes
    assert shapes["lm_head.weight"] == (64, 32)
    assert len(shapes) == 1 + 3 * 7 + 2 * 4 + 4 + 2
    assert "lm_head.weight" not in moegraph_shapes(tiny_cfg(tie_word_embeddings=True))
    # decoder_sparse_step 2: layer 0 dense, layer 1 MoE
    sparse = moegraph_shapes(tiny_cfg(mlp_only_layers=[], decoder_sparse_step=2))
    assert "layers.0.mlp.up_proj.weight" in sparse and "layers.1.moe.w_down" in sparse


def test_hf_table_places_each_expert_tensor():
    table = hf_to_moegraph_names(tiny_cfg())
    assert len(table) == 1 + 3 * 7 + 2 * (2 + 3 * 4) + 4 + 2  # the count transformers writes
    assert table["model.layers.2.mlp.experts.3.gate_proj.weight"] == Slot(
        "layers.2.moe.w_gate_up", (3, slice(0, 16)), (16, 32))
    assert table["model.layers.2.mlp.experts.3.up_proj.weight"] == Slot(
        "layers.2.moe.w_gate_up", (3, slice(16, 32)), (16, 32))
    assert table["model.layers.2.mlp.experts.3.down_proj.weight"] == Slot(
        "layers.2.moe.w_down", (3,), (32, 16))
    assert table["model.layers.0.mlp.gate.weight"] == Slot("layers.0.moe.router.weight", (), (4, 32))
    assert table["model.layers.1.post_attention_layernorm.weight"].name == "layers.1.mlp.post_norm.weight"
    fused = hf_to_moegraph_names(tiny_cfg(), fused_layers={0})
    assert fused["model.layers.0.mlp.experts.gate_up_proj"] == Slot("layers.0.moe.w_gate_up", (), (4, 32, 32))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in fused
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in fused


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 4096], ids=["single", "sharded"])
@pytest.mark.parametrize("cfg", [tiny_cfg(), tiny_cfg(tie_word_embeddings=True, mlp_only_layers=[])],
                         ids=["dense_layer", "tied"])
def test_round_trip_is_bit_identical(tmp_path, cfg, max_shard_bytes, dtype):
    sd = random_state_dict(cfg, dtype)
    written = save_checkpoint(sd, cfg, tmp_path, max_shard_bytes=max_shard_bytes)
    loaded = load_state_dict(tmp_path, cfg)
    assert_bit_identical(loaded, sd)
    assert torch.equal(loaded["layers.0.moe.w_gate_up"], sd["layers.0.moe.w_gate_up"])

    config = json.loads((tmp_path / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    assert config["torch_dtype"] == name and config["dtype"] == name
    assert read_hf_config(tmp_path) == cfg

    weight_files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    itemsize = dtype.itemsize
    total = sum(t.numel() for t in sd.values()) * itemsize
    if max_shard_bytes > total:
        assert weight_files == [SINGLE_FILE]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", SINGLE_FILE]
    else:
        n = len(weight_files)
        assert n > 1 and weight_files == [f"model-{k:05d}-of-{n:05d}.safetensors"
                                          for k in range(1, n + 1)]
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert index["metadata"]["total_size"] == total
        assert sorted(set(index["weight_map"].values())) == weight_files
        for file in weight_files:
            tensors = read_all(tmp_path / file)
            assert {k for k, v in index["weight_map"].items() if v == file} == set(tensors)
            nbytes = sum(t.numel() * itemsize for t in tensors.values())
            assert nbytes <= max_shard_bytes or len(tensors) == 1
    for file in weight_files:
        assert header_of(tmp_path / file)["__metadata__"] == {"format": "pt"}
    assert {p.name for p in written} == {p.name for p in tmp_path.iterdir()}


def test_experts_are_unstacked_exactly(single):
    path, cfg, sd = single
    disk = read_all(path / SINGLE_FILE)
    F = cfg.moe_intermediate_size
    assert "model.layers.0.mlp.experts.gate_up_proj" not in disk
    for i in (0, 2):
        for e in range(cfg.num_experts):
            x = f"model.layers.{i}.mlp.experts.{e}."
            assert torch.equal(disk[x + "gate_proj.weight"], sd[f"layers.{i}.moe.w_gate_up"][e, :F])
            assert torch.equal(disk[x + "up_proj.weight"], sd[f"layers.{i}.moe.w_gate_up"][e, F:])
            assert torch.equal(disk[x + "down_proj.weight"], sd[f"layers.{i}.moe.w_down"][e])
    assert torch.equal(disk["model.layers.1.mlp.up_proj.weight"], sd["layers.1.mlp.up_proj.weight"])
    assert torch.equal(disk["model.layers.1.post_attention_layernorm.weight"],
                       sd["layers.1.mlp.post_norm.weight"])


def test_load_casts_to_the_requested_dtype(single):
    path, cfg, sd = single
    loaded = load_state_dict(path, cfg, dtype=torch.bfloat16)
    assert_bit_identical(loaded, {k: v.to(torch.bfloat16) for k, v in sd.items()})


def test_save_casts_and_the_plan_reports_it(tmp_path):
    cfg, sd = tiny_cfg(), random_state_dict(tiny_cfg())
    save_checkpoint(sd, cfg, tmp_path, dtype=torch.bfloat16)
    plan = plan_load(tmp_path, cfg)
    assert plan.dtype == torch.bfloat16
    assert plan.total_bytes == sum(t.numel() for t in sd.values()) * 2
    read = next(r for r in plan.reads if r.hf_name == "model.layers.2.mlp.experts.1.down_proj.weight")
    assert (read.file, read.dtype, read.shape, read.target) == (SINGLE_FILE, "BF16", (32, 16),
                                                                "layers.2.moe.w_down")
    assert read.offsets[1] - read.offsets[0] == 32 * 16 * 2
    assert_bit_identical(load_state_dict(tmp_path, cfg), {k: v.to(torch.bfloat16) for k, v in sd.items()})


@settings(max_examples=12, deadline=None)
@given(layers=st.integers(1, 4), experts=st.integers(1, 5), step=st.integers(1, 2),
       dense=st.sets(st.integers(0, 3), max_size=2), tied=st.booleans(),
       shard=st.sampled_from([None, 2000, 20000]), bf16=st.booleans())
def test_round_trip_over_configs(layers, experts, step, dense, tied, shard, bf16):
    cfg = tiny_cfg(num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=1,
                   decoder_sparse_step=step, mlp_only_layers=sorted(dense),
                   tie_word_embeddings=tied, vocab_size=16, moe_intermediate_size=8)
    sd = random_state_dict(cfg, torch.bfloat16 if bf16 else torch.float32, seed=layers * 7 + experts)
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(sd, cfg, d, max_shard_bytes=shard)
        assert_bit_identical(load_state_dict(d, cfg), sd)


def test_resave_removes_the_other_layout(sharded):
    path, cfg, sd, _ = sharded
    save_checkpoint(sd, cfg, path)  # now one file
    assert sorted(p.name for p in path.iterdir()) == ["config.json", SINGLE_FILE]
    assert_bit_identical(load_state_dict(path, cfg), sd)


def test_plan_reads_only_headers(tmp_path):
    io_stats = Path("/proc/self/io")
    if not io_stats.exists():
        pytest.skip("needs /proc/self/io")
    cfg = tiny_cfg(vocab_size=8192)  # 1 MiB embedding, 1 MiB lm_head
    save_checkpoint(random_state_dict(cfg), cfg, tmp_path, max_shard_bytes=2**20)

    def bytes_read():
        return int(dict(line.split(": ") for line in io_stats.read_text().splitlines())["rchar"])

    before = bytes_read()
    plan = plan_load(tmp_path, cfg)
    after = bytes_read()
    assert plan.total_bytes > 2 * 2**20
    assert after - before < 64 * 1024


def test_load_opens_each_file_once(sharded, monkeypatch):
    path, cfg, sd, weight_map = sharded
    opened = collections.Counter()
    real_safe_open = ckpt.safe_open

    def counting_safe_open(file, *args, **kwargs):
        opened[Path(file).name] += 1
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(ckpt, "safe_open", counting_safe_open)
    assert_bit_identical(load_state_dict(path, cfg), sd)
    assert opened == collections.Counter(set(weight_map.values()))


# -- transformers interop ---------------------------------------------------------------------


def transformers_names(cfg: ModelConfig) -> dict[str, str]:
    """moegraph name -> transformers 5.x in-memory parameter name, written out independently of
    the module's table."""
    names = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        names[f"layers.{i}.attn.input_norm.weight"] = hf + "input_layernorm.weight"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            names[f"layers.{i}.attn.{p}.weight"] = hf + f"self_attn.{p}.weight"
        if i in cfg.mlp_only_layers:
            names[f"layers.{i}.mlp.post_norm.weight"] = hf + "post_attention_layernorm.weight"
            for p in ("gate_proj", "up_proj", "down_proj"):
                names[f"layers.{i}.mlp.{p}.weight"] = hf + f"mlp.{p}.weight"
        else:
            names[f"layers.{i}.moe.post_norm.weight"] = hf + "post_attention_layernorm.weight"
            names[f"layers.{i}.moe.router.weight"] = hf + "mlp.gate.weight"
            names[f"layers.{i}.moe.w_gate_up"] = hf + "mlp.experts.gate_up_proj"
            names[f"layers.{i}.moe.w_down"] = hf + "mlp.experts.down_proj"
    return names


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_checkpoint_loads_and_ours_loads_in_transformers(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf_cfg)
    with torch.no_grad():
        for p in model.parameters():  # distinct values everywhere, norms included
            p.normal_()
    params = dict(model.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")

    weight_map = json.loads((tmp_path / "theirs" / INDEX_FILE).read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in weight_map  # per-expert on disk
    assert len(set(weight_map.values())) > 1
    cfg = read_hf_config(tmp_path / "theirs")  # 5.x spelling: num_local_experts, rope_parameters
    assert (cfg.num_experts, cfg.mlp_only_layers, cfg.tie_word_embeddings) == (4, [1], tied)

    loaded = load_state_dict(tmp_path / "theirs", cfg)
    names = transformers_names(cfg)
    assert set(loaded) == set(names)
    for name, hf_name in names.items():
        assert torch.equal(loaded[name], params[hf_name]), name

    save_checkpoint(loaded, cfg, tmp_path / "ours", max_shard_bytes=30_000)
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours")
    assert reloaded.config.num_local_experts == 4
    assert reloaded.config.rope_parameters["rope_theta"] == cfg.rope_theta
    for hf_name, p in reloaded.named_parameters():
        assert torch.equal(p, params[hf_name]), hf_name


# -- the fused spelling and tied heads --------------------------------------------------------


def test_fused_expert_spelling_loads(single):
    path, cfg, sd = single
    disk = read_all(path / SINGLE_FILE)
    disk = {k: v for k, v in disk.items() if not k.startswith("model.layers.0.mlp.experts.")}
    disk["model.layers.0.mlp.experts.gate_up_proj"] = sd["layers.0.moe.w_gate_up"]
    disk["model.layers.0.mlp.experts.down_proj"] = sd["layers.0.moe.w_down"]
    save_file(disk, path / SINGLE_FILE, metadata={"format": "pt"})
    assert plan_load(path, cfg).fused_layers == {0}
    assert_bit_identical(load_state_dict(path, cfg), sd)


def test_a_layer_mixing_expert_spellings_is_refused(single):
    path, cfg, sd = single
    disk = read_all(path / SINGLE_FILE)
    disk["model.layers.2.mlp.experts.gate_up_proj"] = sd["layers.2.moe.w_gate_up"]
    save_file(disk, path / SINGLE_FILE)
    with pytest.raises(CheckpointError) as e:
        plan_load(path, cfg)
    assert message(e) == (
        "checkpoint: tensor model.layers.2.mlp.experts.gate_up_proj in model.safetensors is the "
        "fused expert spelling but layer 2 also has model.layers.2.mlp.experts.0.down_proj.weight "
        "in model.safetensors; a layer must use one spelling")


def test_tied_lm_head_on_disk_is_ignored_if_shaped_like_the_embedding(tmp_path):
    cfg = tiny_cfg(tie_word_embeddings=True)
    sd = random_state_dict(cfg)
    save_checkpoint(sd, cfg, tmp_path)
    disk = read_all(tmp_path / SINGLE_FILE)
    save_file({**disk, "lm_head.weight": torch.zeros(64, 32)}, tmp_path / SINGLE_FILE)
    assert_bit_identical(load_state_dict(tmp_path, cfg), sd)

    save_file({**disk, "lm_head.weight": torch.zeros(64, 31)}, tmp_path / SINGLE_FILE)
    with pytest.raises(CheckpointError) as e:
        load_state_dict(tmp_path, cfg)
    assert message(e) == ("checkpoint: tensor lm_head.weight in model.safetensors has shape "
                          "[64, 31], config says [64, 32]")


def test_config_json_is_the_hf_dict_plus_dtype(single):
    path, cfg, _ = single
    config = json.loads((path / "config.json").read_text())
    want = {**cfg.to_hf_dict(), "torch_dtype": "float32", "dtype": "float32"}
    assert config == json.loads(json.dumps(want))
    assert os.path.getsize(path / "config.json") > 0
