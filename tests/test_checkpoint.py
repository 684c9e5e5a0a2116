"""Checkpoint I/O: round trips are bit-identical, transformers' checkpoints load (and ours load in
transformers), and every bad checkpoint fails before any large read with a one-line message
naming the tensor and the file."""

from __future__ import annotations

import collections
import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import moegraph_cli.io.checkpoint as ckpt
from moegraph_cli.io.checkpoint import (INDEX_FILE, SINGLE_FILE, Slot, hf_to_moegraph_names,
                                        load_state_dict, moegraph_shapes, plan_load,
                                        save_checkpoint)
from moegraph_cli.config import ModelConfig, read_hf_config
from moegraph_cli.errors import CheckpointError

# -- fixtures -------------------------------------------------------------------------------


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


# -- errors: names, shapes, dtypes ------------------------------------------------------------


def rewrite(file: Path, change) -> None:
    tensors = read_all(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def plan_error(path, cfg) -> str:
    with pytest.raises(CheckpointError) as e:
        plan_load(path, cfg)
    return message(e)


def test_missing_tensor(single):
    path, cfg, _ = single
    rewrite(path / SINGLE_FILE, lambda t: t.pop("model.norm.weight"))
    assert plan_error(path, cfg) == "checkpoint: tensor model.norm.weight is missing from model.safetensors"


def test_missing_expert_counts_the_rest(single):
    path, cfg, _ = single

    def drop_expert(t):
        for p in ("gate_proj", "up_proj", "down_proj"):
            t.pop(f"model.layers.2.mlp.experts.3.{p}.weight")

    rewrite(path / SINGLE_FILE, drop_expert)
    assert plan_error(path, cfg) == ("checkpoint: tensor model.layers.2.mlp.experts.3.gate_proj.weight "
                                     "is missing from model.safetensors (and 2 more missing)")


def test_missing_tensor_in_a_sharded_checkpoint_names_the_index(sharded):
    path, cfg, _, weight_map = sharded
    key = "model.layers.0.self_attn.v_proj.weight"
    rewrite(path / weight_map.pop(key), lambda t: t.pop(key))
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert plan_error(path, cfg) == f"checkpoint: tensor {key} is missing from {INDEX_FILE}"


def test_unexpected_tensor(single):
    path, cfg, _ = single
    rewrite(path / SINGLE_FILE,
            lambda t: t.update({"model.layers.0.mlp.experts.4.gate_proj.weight": torch.zeros(16, 32)}))
    assert plan_error(path, cfg) == (
        "checkpoint: tensor model.layers.0.mlp.experts.4.gate_proj.weight in model.safetensors is "
        f"not a parameter of the config's model ({CONFIG_SUMMARY})")


def test_checkpoint_for_another_config_is_refused(single):
    path, _, _ = single
    assert plan_error(path, tiny_cfg(mlp_only_layers=[])) == (
        "checkpoint: tensor model.layers.1.mlp.gate.weight is missing from model.safetensors "
        "(and 12 more missing)")


def test_wrong_shape_names_tensor_and_shard(sharded):
    path, cfg, _, weight_map = sharded
    key = "model.layers.2.mlp.experts.3.up_proj.weight"
    file = weight_map[key]
    assert file.startswith("model-000")
    rewrite(path / file, lambda t: t.update({key: torch.zeros(16, 24)}))
    assert plan_error(path, cfg) == (f"checkpoint: tensor {key} in {file} has shape [16, 24], "
                                     "config says [16, 32]")


def test_int_tensor_is_refused(single):
    path, cfg, _ = single
    rewrite(path / SINGLE_FILE,
            lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(4, 32, dtype=torch.int64)}))
    assert plan_error(path, cfg) == ("checkpoint: tensor model.layers.0.mlp.gate.weight in "
                                     "model.safetensors has dtype I64; moegraph loads F32, BF16, F16")


def test_mixed_dtypes_are_refused(single):
    path, cfg, sd = single
    rewrite(path / SINGLE_FILE,
            lambda t: t.update({"model.norm.weight": sd["norm.weight"].to(torch.bfloat16)}))
    assert plan_error(path, cfg) == (
        "checkpoint: tensor model.norm.weight in model.safetensors has dtype BF16 but "
        "model.embed_tokens.weight in model.safetensors has F32; a checkpoint holds one dtype")


# -- errors: the files themselves -------------------------------------------------------------


def test_truncated_file(single):
    path, cfg, _ = single
    file = path / SINGLE_FILE
    header = header_of(file)
    header.pop("__metadata__")
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 10)
    assert plan_error(path, cfg) == (f"checkpoint: model.safetensors is truncated: tensor {last} "
                                     f"ends at byte {size} but the file has {size - 10} bytes")


def test_header_length_past_the_end(single):
    path, cfg, _ = single
    file = path / SINGLE_FILE
    raw = bytearray(file.read_bytes())
    raw[:8] = struct.pack("<Q", 2**40)
    file.write_bytes(raw)
    assert plan_error(path, cfg) == ("checkpoint: model.safetensors has a corrupt header: header "
                                     f"length {2**40} does not fit in the file's {len(raw)} bytes")


def test_header_that_is_not_json(tmp_path):
    text = b"{not json"
    (tmp_path / SINGLE_FILE).write_bytes(struct.pack("<Q", len(text)) + text)
    assert plan_error(tmp_path, tiny_cfg()) == (
        "checkpoint: model.safetensors has a corrupt header: not valid JSON (Expecting property "
        "name enclosed in double quotes)")


def f32(offsets, shape=(4,)):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("header, data_bytes, why", [
    ({"a": f32([0, 16]), "b": f32([8, 24])}, 24, "corrupt header: tensors a and b overlap"),
    ({"a": f32([0, 16]), "b": f32([20, 36])}, 36, "corrupt header: 4 unused bytes before tensor b"),
    ({"a": f32([0, 8])}, 8, "corrupt header: tensor a spans bytes 0..8 but F32 [4] needs 16"),
    ({"a": {"dtype": "F32", "shape": [4]}}, 16, "corrupt header: tensor a needs dtype, shape and data_offsets"),
    ({"a": f32([0, 16]) | {"dtype": "Q7"}}, 16, "corrupt header: tensor a has unknown dtype 'Q7'"),
    ({"a": f32([0, 16])}, 20, "corrupt header: 4 bytes after the last tensor"),
], ids=["overlap", "gap", "span", "fields", "dtype", "trailing"])
def test_corrupt_offsets(tmp_path, header, data_bytes, why):
    raw_safetensors(tmp_path / SINGLE_FILE, header, bytes(data_bytes))
    assert plan_error(tmp_path, tiny_cfg()) == f"checkpoint: model.safetensors has a {why}"


def test_offsets_outside_the_file(tmp_path):
    raw_safetensors(tmp_path / SINGLE_FILE, {"a": f32([0, 16])}, bytes(8))
    size = (tmp_path / SINGLE_FILE).stat().st_size
    assert plan_error(tmp_path, tiny_cfg()) == (
        f"checkpoint: model.safetensors is truncated: tensor a ends at byte {size + 8} but the "
        f"file has {size} bytes")


def test_index_naming_a_missing_file(sharded):
    path, cfg, _, weight_map = sharded
    gone = sorted(set(weight_map.values()))[1]
    (path / gone).unlink()
    first = next(k for k, v in weight_map.items() if v == gone)
    assert plan_error(path, cfg) == (f"checkpoint: {INDEX_FILE} names {gone} for tensor {first}, "
                                     f"but {path / gone} does not exist")


def test_index_naming_the_wrong_file(sharded):
    path, cfg, _, weight_map = sharded
    key = "model.norm.weight"
    actual = weight_map[key]
    weight_map[key] = next(f for f in weight_map.values() if f != actual)
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    assert plan_error(path, cfg) == (f"checkpoint: tensor {key} is in {actual} but {INDEX_FILE} "
                                     f"says {weight_map[key]}")


def test_index_naming_a_tensor_no_file_has(sharded):
    path, cfg, _, weight_map = sharded
    file = weight_map["model.norm.weight"]
    weight_map["model.layers.9.input_layernorm.weight"] = file
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    assert plan_error(path, cfg) == ("checkpoint: tensor model.layers.9.input_layernorm.weight is "
                                     f"not in {file}, where {INDEX_FILE} says it is")


def test_index_that_is_not_json(sharded):
    path, cfg, _, _ = sharded
    (path / INDEX_FILE).write_text('{"weight_map": ')
    assert plan_error(path, cfg) == (f"checkpoint: {INDEX_FILE} is not valid JSON (Expecting "
                                     "value at line 1)")


def test_directory_layouts(tmp_path, single):
    assert plan_error(tmp_path / "nowhere", tiny_cfg()) == f"checkpoint {tmp_path / 'nowhere'} does not exist"
    (tmp_path / "empty").mkdir()
    assert plan_error(tmp_path / "empty", tiny_cfg()) == (
        f"checkpoint {tmp_path / 'empty'} has no {SINGLE_FILE} or {INDEX_FILE}")
    path, cfg, sd = single
    assert_bit_identical(load_state_dict(path / SINGLE_FILE, cfg), sd)  # a file path works too
    (path / INDEX_FILE).write_text("{}")
    assert plan_error(path, cfg) == (f"checkpoint {path} has both {SINGLE_FILE} and {INDEX_FILE}; "
                                     "remove the stale one")


# -- errors: saving ---------------------------------------------------------------------------


def save_error(sd, cfg, path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(sd, cfg, path, **kwargs)
    return message(e)


def test_save_checks_the_state_dict(tmp_path):
    cfg = tiny_cfg()
    sd = random_state_dict(cfg)
    assert save_error({k: v for k, v in sd.items() if k != "layers.2.moe.w_down"}, cfg, tmp_path) == (
        "checkpoint: state dict is missing layers.2.moe.w_down")
    assert save_error({**sd, "layers.0.moe.w_gate_up": torch.zeros(4, 16, 32)}, cfg, tmp_path) == (
        "checkpoint: state dict tensor layers.0.moe.w_gate_up has shape [4, 16, 32], config says "
        "[4, 32, 32]")
    assert save_error({**sd, "layers.3.attn.q_norm.weight": torch.zeros(8)}, cfg, tmp_path) == (
        "checkpoint: state dict tensor layers.3.attn.q_norm.weight is not a parameter of the "
        f"config's model ({CONFIG_SUMMARY})")
    assert save_error({**sd, "norm.weight": sd["norm.weight"].half()}, cfg, tmp_path) == (
        "checkpoint: state dict mixes torch.float32 (embed_tokens.weight) and torch.float16 "
        "(norm.weight); pass dtype= to save in one dtype")
    assert list(tmp_path.iterdir()) == []  # nothing written on error
    save_checkpoint({**sd, "norm.weight": sd["norm.weight"].half()}, cfg, tmp_path, dtype=torch.float32)
    assert load_state_dict(tmp_path, cfg)["norm.weight"].dtype == torch.float32


def test_save_accepts_a_tied_head_only_if_it_is_the_embedding(tmp_path):
    cfg = tiny_cfg(tie_word_embeddings=True)
    sd = random_state_dict(cfg)
    save_checkpoint({**sd, "lm_head.weight": sd["embed_tokens.weight"]}, cfg, tmp_path)
    assert "lm_head.weight" not in read_all(tmp_path / SINGLE_FILE)
    assert save_error({**sd, "lm_head.weight": torch.zeros(64, 32)}, cfg, tmp_path) == (
        "checkpoint: state dict has an lm_head.weight that differs from embed_tokens.weight, but "
        "the config ties them")


def test_config_json_is_the_hf_dict_plus_dtype(single):
    path, cfg, _ = single
    config = json.loads((path / "config.json").read_text())
    want = {**cfg.to_hf_dict(), "torch_dtype": "float32", "dtype": "float32"}
    assert config == json.loads(json.dumps(want))
    assert os.path.getsize(path / "config.json") > 0
