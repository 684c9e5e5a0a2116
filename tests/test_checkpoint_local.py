"""load_local_: a sharded or expert-parallel model loaded from an HF checkpoint holds exactly the
rows of the full load, and reads only what this rank owns."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from gloo_util import run_gloo
from sharded_util import expert_ranges, fsdp_model, gathered, meta_model, tiny_cfg

import moegraph_cli.io.checkpoint_local as ckpt_local
from moegraph_cli.io.checkpoint_save import save_checkpoint
from moegraph_cli.io.hf_names import SINGLE_FILE
from moegraph_cli.io.checkpoint_local import load_local_
from moegraph_cli.errors import CheckpointError
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.models.common.init import is_expert_stack

LAYOUTS = ["single", "sharded", "fused"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def write_checkpoint(root: Path, layout: str) -> Path:
    """An fp32 checkpoint of from_config(tiny_cfg(), seed=7) in one layout: one file; shards of
    at most 4 KiB (about 20 files); or one file with layer 0's experts in the fused spelling
    (layer 2 keeps the per-expert one)."""
    cfg, path = tiny_cfg(), root / layout
    state = MoeCausalLM.from_config(cfg, seed=7, dtype=torch.float32).state_dict()
    save_checkpoint(state, cfg, path, max_shard_bytes=4096 if layout == "sharded" else None)
    if layout == "fused":
        with safe_open(path / SINGLE_FILE, framework="pt") as f:
            disk = {k: f.get_tensor(k) for k in f.keys()
                    if not k.startswith("model.layers.0.mlp.experts.")}
        disk["model.layers.0.mlp.experts.gate_up_proj"] = state["layers.0.moe.w_gate_up"]
        disk["model.layers.0.mlp.experts.down_proj"] = state["layers.0.moe.w_down"]
        save_file(disk, path / SINGLE_FILE, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {layout: write_checkpoint(root, layout) for layout in LAYOUTS}


class ReadLog:
    """Wraps safe_open: counts opens per file and records every tensor read, as (key, rows)
    with rows None for a whole-tensor get_tensor and the slice for a get_slice read."""

    def __init__(self):
        self.opens = collections.Counter()
        self.reads: list[tuple[str, slice | None]] = []

    def safe_open(self, file, *args, **kwargs):
        self.opens[Path(file).name] += 1
        log, handle = self, safe_open(file, *args, **kwargs)

        class Logged:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_tensor(self, key):
                log.reads.append((key, None))
                return handle.get_tensor(key)

            def get_slice(self, key):
                rows = handle.get_slice(key)

                class Rows:
                    def __getitem__(self, index):
                        log.reads.append((key, index))
                        return rows[index]
                return Rows()
        return Logged()

    def keys(self) -> set[str]:
        return {key for key, _ in self.reads}


def expert_of(key: str) -> int | None:
    parts = key.split(".")  # model.layers.{i}.mlp.experts.{e}.gate_proj.weight
    return int(parts[5]) if len(parts) > 6 and parts[4] == "experts" else None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_local_experts_hold_the_full_loads_slice_and_read_only_theirs(checkpoints, layout,
                                                                      monkeypatch):
    cfg, path, (lo, hi) = tiny_cfg(), checkpoints[layout], (2, 6)
    full = dict(MoeCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    log = ReadLog()
    monkeypatch.setattr(ckpt_local, "safe_open", log.safe_open)
    local = meta_model(cfg, (lo, hi)).to_empty(device="cpu")
    with torch.no_grad():
        for p in local.parameters():
            p.fill_(float("nan"))  # so a row left unread cannot pass as right by chance
    load_local_(local, path, cfg, expert_range=(lo, hi))

    for name, p in local.named_parameters():
        want = full[name][lo:hi] if is_expert_stack(name) else full[name]
        assert p.shape == want.shape and torch.equal(bits(p), bits(want)), name

    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert sorted(log.opens) == files and set(log.opens.values()) == {1}
    if layout == "sharded":
        assert len(files) > 10
    experts_read = {(key.split(".")[2], expert_of(key)) for key in log.keys()
                    if expert_of(key) is not None}
    per_expert_layers = ["2"] if layout == "fused" else ["0", "2"]
    assert experts_read == {(i, e) for i in per_expert_layers for e in range(lo, hi)}
    assert all(rows is None for key, rows in log.reads if expert_of(key) is not None)
    if layout == "fused":
        fused = {key: rows for key, rows in log.reads if key.endswith(("gate_up_proj", "down_proj"))
                 and expert_of(key) is None}
        assert fused == {"model.layers.0.mlp.experts.gate_up_proj": slice(2, 6),
                         "model.layers.0.mlp.experts.down_proj": slice(2, 6)}


def test_loading_casts_to_the_parameters_dtype(checkpoints):
    cfg, path = tiny_cfg(), checkpoints["single"]
    full = dict(MoeCausalLM.from_pretrained(path, dtype=torch.bfloat16).named_parameters())
    local = meta_model(cfg, (6, 8), dtype=torch.bfloat16).to_empty(device="cpu")
    load_local_(local, path, cfg, expert_range=(6, 8))
    for name, p in local.named_parameters():
        want = full[name][6:8] if is_expert_stack(name) else full[name]
        assert p.dtype == torch.bfloat16 and torch.equal(bits(p), bits(want)), name


def test_a_model_the_checkpoint_cannot_fill_is_refused(checkpoints):
    cfg, path = tiny_cfg(), checkpoints["single"]
    other = meta_model(tiny_cfg(mlp_only_layers=[]), (0, 8)).to_empty(device="cpu")
    with pytest.raises(CheckpointError) as e:
        load_local_(other, path, cfg)
    assert "\n" not in str(e.value)
    assert str(e.value) == (
        f"checkpoint: no tensor in {path} fills model parameter layers.1.moe.w_gate_up; "
        "the config's model (3 layers, 8 experts, mlp_only_layers [1], decoder_sparse_step 1, "
        "tie_word_embeddings false) has no such parameter")

    past_the_end = meta_model(cfg, (6, 10)).to_empty(device="cpu")
    with pytest.raises(CheckpointError, match=r"^checkpoint: parameter layers.0.moe.w_gate_up "
                                              r"holds experts 6..9 but the checkpoint has 8 "
                                              r"experts$"):
        load_local_(past_the_end, path, cfg, expert_range=(6, 10))


@pytest.mark.parametrize("layout", ["single", "fused"])
def test_a_non_finite_weight_is_found_by_the_rank_that_reads_it(checkpoints, tmp_path, layout):
    """Expert 3 of layer 0 holds a NaN: a rank holding experts 2..3 names it (per expert or
    fused, by its HF name and its place on disk); one holding 0..1 never reads it and loads;
    without check_finite the NaN loads as it is."""
    import shutil

    from safetensors.torch import load_file

    cfg, path = tiny_cfg(), tmp_path / layout
    shutil.copytree(checkpoints[layout], path)
    tensors = load_file(path / SINGLE_FILE)
    if layout == "single":
        name, index, what = "model.layers.0.mlp.experts.3.up_proj.weight", (5, 1), "[5, 1]"
    else:  # [E, 2F, H]: expert 3, the up row 12 + 5
        name, index, what = "model.layers.0.mlp.experts.gate_up_proj", (3, 17, 1), "[3, 17, 1]"
    tensors[name][index] = float("nan")
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})

    load_local_(meta_model(cfg, (0, 2)).to_empty(device="cpu"), path, cfg, (0, 2),
                check_finite=True)
    holder = meta_model(cfg, (2, 4)).to_empty(device="cpu")
    with pytest.raises(CheckpointError) as e:
        load_local_(holder, path, cfg, (2, 4), check_finite=True)
    assert str(e.value) == (f"checkpoint: tensor {name} in {SINGLE_FILE} is not finite (nan "
                            f"at {what})")
    load_local_(holder, path, cfg, (2, 4))
    assert torch.isnan(holder.layers[0].moe.w_gate_up[1, 12 + 5, 1])


def _fsdp_load_equals_full_load(rank: int, world: int, paths: list[str]) -> None:
    """Every rank: FSDP2 dense shards plus its expert range, loaded from each checkpoint,
    gathered whole and compared with the full load; dense tensors read as this rank's rows."""
    from torch.distributed.tensor import DTensor

    cfg = tiny_cfg()
    lo, hi = expert_ranges(cfg.num_experts, world)[rank]
    for path in paths:
        model = fsdp_model(cfg, expert_range=(lo, hi))
        log = ReadLog()
        real_safe_open, ckpt_local.safe_open = ckpt_local.safe_open, log.safe_open
        try:
            load_local_(model, path, cfg, expert_range=(lo, hi))
        finally:
            ckpt_local.safe_open = real_safe_open
        embed = model.embed_tokens.weight
        assert isinstance(embed, DTensor)
        rows = embed.to_local().shape[0]
        got = gathered(model)  # collective: before any assert that could end one rank early
        full = dict(MoeCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
        for name, p in got.items():
            want = full[name][lo:hi] if is_expert_stack(name) else full[name]
            assert p.shape == want.shape and torch.equal(bits(p), bits(want)), (rank, path, name)
        start = [0, 34][rank]  # vocab 67 over two ranks: rows 0..33 and 34..66
        assert rows == [34, 33][rank]
        assert ("model.embed_tokens.weight", slice(start, start + rows)) in log.reads
        assert {expert_of(k) for k in log.keys()} - {None} == set(range(lo, hi))


def test_fsdp2_ranks_load_their_rows_and_experts(checkpoints):
    run_gloo(_fsdp_load_equals_full_load, 2, [str(checkpoints["sharded"]),
                                           str(checkpoints["fused"])])
