"""Checkpoint I/O: every bad checkpoint fails before any large read with a one-line message
naming the tensor and the file, and a state dict that is not the config's model is refused
before anything is written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_util import (CONFIG_SUMMARY, assert_bit_identical, header_of, message,
                             random_state_dict, raw_safetensors, read_all, sharded, single,
                             tiny_cfg)
from moegraph_cli.errors import CheckpointError
from moegraph_cli.io.checkpoint import load_state_dict, plan_load
from moegraph_cli.io.checkpoint_save import save_checkpoint
from moegraph_cli.io.hf_names import INDEX_FILE, SINGLE_FILE


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
