"""Every input file and value a user hands the CLI (issue 12): profiles, config.json, plans,
savings, calibrations, token files, --set, and the GPU commands' options, checked before the
device. Each case asserts the exit code, that stderr is one line, and the words that name the
file, the field and the problem."""

import json
import pickle

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from cli_util import one_line, run_cli, tiny_checkpoint
from moegraph_cli.plan.runkey import run_key
from moegraph_cli.train.runspec import resolve

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# -- profile YAML --------------------------------------------------------------------------
PROFILE_CASES = [
    ("syntax", "model:\n  hidden_size: [1\nrun: {}\n",
     ["p.yaml:3:4: not valid YAML", "flow sequence from line 2"]),
    ("section-not-mapping", "model: 3\n", ["p.yaml:1:", "section 'model' must be a mapping"]),
    ("section-a-list", "name: x\nrun: [1, 2]\n", ["p.yaml:2:", "section 'run' must be a mapping"]),
    ("empty", "", ["p.yaml: the file is empty", "sections model, run and moe"]),
    ("only-comments", "# nothing\n", ["the file is empty"]),
    ("top-level-list", "- model\n- run\n", ["expected a mapping with the sections", "a list"]),
    ("top-level-string", "hello\n", ["expected a mapping", "the string 'hello'"]),
    ("binary", b"\xff\xfe\x00model", ["not a text file (byte 0 is not UTF-8)"]),
    ("nul-byte", "model:\n  x: 1\x00\n", ["p.yaml:2: not valid YAML", "U+0000"]),
    ("unknown-section", "name: x\nmodle: {}\n", ["p.yaml:2: unknown section 'modle'"]),
    ("unknown-field", "run:\n  batch: 2\n  sequence: 9\n",
     ["p.yaml:3: unknown field 'sequence' in section run", "run fields are"]),
    ("wrong-type", "run:\n  seq_len: long\n", ["p.yaml:2: run.seq_len: expected int, got 'long'"]),
    ("bool-for-int", "model:\n  num_experts: true\n",
     ["p.yaml:2: model.num_experts: expected int"]),
    ("invalid-value", "run:\n  dtype: float32\n  batch: 0\n",
     ["p.yaml:3: run.batch must be positive, got 0"]),
    ("name-not-string", "name: [1]\n", ["p.yaml:1: name must be a string"]),
    ("mlp-only-layers", "model:\n  num_hidden_layers: 2\n  mlp_only_layers: [0, 2]\n",
     ["p.yaml:3: model.mlp_only_layers holds 2", "layers 0..1 with num_hidden_layers 2"]),
    ("negative-layer", "model:\n  mlp_only_layers: [-1]\n", ["model.mlp_only_layers holds -1"]),
    ("timestamp", "run:\n  seed: 2001-02-30\n", ["p.yaml: not valid YAML", "day is out of range"]),
    ("not-finite", "run:\n  lr: .nan\n", ["p.yaml:2: run.lr: expected a finite number"]),
]


@pytest.mark.parametrize("name,text,needles", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_bad_profile_file(tmp_path, name, text, needles):
    path = write(tmp_path / "p.yaml", text)
    one_line(*run_cli("inspect", "--profile", path), 2, f"profile {path}", *needles)


def test_profile_path_that_is_missing_or_a_directory(tmp_path):
    one_line(*run_cli("inspect", "--profile", tmp_path / "none.yaml"), 2,
             f"profile {tmp_path / 'none.yaml'}: no such file")
    (tmp_path / "d.yaml").mkdir()
    one_line(*run_cli("inspect", "--profile", tmp_path / "d.yaml"), 2, "not a regular file")


def test_good_profile_file_and_scientific_notation(tmp_path):
    path = write(tmp_path / "p.yaml", "name: mine\nmodel:\n  rms_norm_eps: 1e-5\nrun:\n"
                                      "  batch: 1\n# comment\n")
    code, out, err = run_cli("inspect", "--profile", path, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["name"] == "mine" and summary["run"]["batch"] == 1


# -- --set ---------------------------------------------------------------------------------
SET_CASES = [
    ("model=3", ["--set 'model=3': model is a section, not a field",
                 "write --set model.FIELD=VALUE", "hidden_size"]),
    ("run=3", ["run is a section, not a field", "--set run.FIELD=VALUE"]),
    ("moe.=x", ["moe is a section, not a field"]),
    ("runs.seq_len=3", ["--set 'runs.seq_len': unknown key; sections are model, run, moe"]),
    ("run.sequence=3", ["--set 'run.sequence': unknown key; run fields are"]),
    ("run.seq_len=[1", ["--set run.seq_len: not valid YAML"]),
    ("run.lr=.nan", ["--set run.lr: expected a finite number, got nan"]),
    ("model.rms_norm_eps=.inf", ["expected a finite number, got inf"]),
    ("model.mlp_only_layers=[2]", ["model.mlp_only_layers holds 2",
                                   "layers 0..1 with num_hidden_layers 2"]),
    ("model.mlp_only_layers=1", ["--set model.mlp_only_layers: expected a list, got 1"]),
    ("run.device=gpu", ["run.device 'gpu' must be auto, cpu, cuda or cuda:N"]),
    ("run.seed=-1", ["run.seed must be in 0..4294967295, got -1"]),
    ("run.warmup=-1", ["run.warmup must be >= 0, got -1"]),
    ("run.weight_decay=-0.1", ["run.weight_decay must be >= 0"]),
    ("run.pipeline_interleave=0", ["run.pipeline_interleave must be positive"]),
    ("model.intermediate_size=0", ["model.intermediate_size must be positive"]),
    ("model.num_experts=-1", ["model.num_experts must be >= 0"]),
    ("run.data=", ["run.data is empty"]),
    ("run.seed=2001-02-30", ["--set run.seed: not valid YAML: day is out of range"]),
]


@pytest.mark.parametrize("item,needles", SET_CASES, ids=[c[0] for c in SET_CASES])
def test_bad_set(item, needles):
    one_line(*run_cli("inspect", "--set", item), 2, *needles)


@pytest.mark.parametrize("field", ["model.vocab_size", "model.hidden_size", "run.seq_len",
                                   "run.batch"])
def test_huge_numbers_are_refused_not_overflowed(field):
    one_line(*run_cli("inspect", "--set", f"{field}=1{'0' * 400}"), 2,
             f"{field} 1000", "is too large (at most 2147483647)")
    one_line(*run_cli("inspect", "--set", f"run.lr=1{'0' * 400}"), 2,
             "--set run.lr: expected a finite number")


# -- config.json ---------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path):
    return tiny_checkpoint(tmp_path / "ck", "--json")


def _config(ckpt, edit):
    path = ckpt / "config.json"
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


CONFIG_CASES = [
    ("json-list", lambda p: p.write_text("[1, 2]"),
     ["config.json: expected a JSON object of config fields, got a list"]),
    ("json-string", lambda p: p.write_text('"qwen3_moe"'), ["got the string 'qwen3_moe'"]),
    ("binary", lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\xff"),
     ["config.json: not a text file (byte 0 is not UTF-8)"]),
    ("syntax", lambda p: p.write_text('{"a": 1,\n "b": }'), ["config.json: invalid JSON",
                                                              "line 2"]),
    ("deep", lambda p: p.write_text("[" * 100000), ["config.json: invalid JSON"]),
]


@pytest.mark.parametrize("name,edit,needles", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_json_document(ckpt, name, edit, needles):
    edit(ckpt / "config.json")
    one_line(*run_cli("inspect", ckpt), 2, *needles)


FIELD_CASES = [
    ("no-model-type", lambda d: d.pop("model_type"),
     ["config.json: no model_type field", "\"model_type\": \"qwen3_moe\""]),
    ("other-model-type", lambda d: d.update(model_type="llama"), ["model_type is 'llama'"]),
    ("string-for-int", lambda d: d.update(hidden_size="32"),
     ["config.json: hidden_size: expected int, got '32'"]),
    ("zero-heads", lambda d: d.update(num_attention_heads=0, head_dim=None),
     ["config.json: num_attention_heads must be positive, got 0"]),
    ("mlp-only-layers", lambda d: d.update(mlp_only_layers=[7]),
     ["config.json: mlp_only_layers holds 7, which is not a layer of the model"]),
    ("rope-not-object", lambda d: d.update(rope_scaling="yarn"),
     ["config.json: rope_scaling must be an object or null, got 'yarn'"]),
    ("missing-field", lambda d: d.pop("vocab_size"), ["missing required field 'vocab_size'"]),
]


@pytest.mark.parametrize("name,edit,needles", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_bad_config_json_field(ckpt, name, edit, needles):
    _config(ckpt, edit)
    one_line(*run_cli("inspect", ckpt), 2, *needles)


def test_config_json_without_head_dim_derives_it(ckpt):
    _config(ckpt, lambda d: d.pop("head_dim"))
    code, out, err = run_cli("inspect", ckpt, "--json")
    assert code == 0, err


# -- plan --checkpoint reads the headers ----------------------------------------------------
def _rewrite(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _truncate(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


CHECKPOINT_CASES = [
    ("truncated", _truncate, ["model.safetensors"]),
    ("incomplete", lambda c: _rewrite(c, lambda t: t.pop("model.layers.1.mlp.gate.weight")),
     ["tensor model.layers.1.mlp.gate.weight is missing from model.safetensors"]),
    ("mis-shaped", lambda c: _rewrite(c, lambda t: t.__setitem__(
        "model.layers.0.mlp.experts.7.up_proj.weight", torch.zeros(16, 31))),
     ["model.layers.0.mlp.experts.7.up_proj.weight in model.safetensors has shape [16, 31], "
      "config says [16, 32]"]),
    ("mixed-dtype", lambda c: _rewrite(c, lambda t: t.__setitem__(
        "model.norm.weight", t["model.norm.weight"].to(torch.bfloat16))),
     ["model.norm.weight in model.safetensors has dtype BF16", "a checkpoint holds one dtype"]),
]


@pytest.mark.parametrize("name,damage,needles", CHECKPOINT_CASES,
                         ids=[c[0] for c in CHECKPOINT_CASES])
def test_plan_checkpoint_reads_headers_first(ckpt, name, damage, needles):
    damage(ckpt)
    one_line(*run_cli("plan", "--checkpoint", ckpt, "--budget", "1GiB"), 1, "checkpoint: ",
             *needles)


def test_plan_good_checkpoint(ckpt):
    code, out, err = run_cli("plan", "--checkpoint", ckpt, "--budget", "1GiB", "--json")
    assert code == 0, err
    assert json.loads(out)["source"] == f"checkpoint {ckpt}"


# -- plan, savings, calibration files -------------------------------------------------------
@pytest.fixture
def good_plan(tmp_path):
    path = tmp_path / "plan.yaml"
    code, _, err = run_cli("plan", "--budget", "1.5GiB", "--out", path)
    assert code == 0, err
    return path


def _edit_plan(path, edit):
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


PLAN_CASES = [
    ("missing", None, ["no such file", "write one with `moegraph plan --out`"]),
    ("syntax", "moegraph_plan: 1\nlayers: [\n", ["plan.yaml:3:1: not valid YAML"]),
    ("binary", b"\x00\xff\xfe", ["not a text file (byte 1 is not UTF-8)"]),
    ("empty", "", ["the file is empty; expected a moegraph plan"]),
    ("list", "- 1\n- 2\n", ["not a moegraph plan: expected a mapping that starts "
                            "moegraph_plan: 1, got a list"]),
    ("no-marker", "pool: shared\n", ["plan.yaml:1: not a moegraph plan: no moegraph_plan field"]),
    ("version", "moegraph_plan: 2\n", ["plan.yaml:1: moegraph_plan is 2; this moegraph reads "
                                       "version 1"]),
]


@NO_CUDA
@pytest.mark.parametrize("name,content,needles", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_capture_bad_plan_file_before_the_device(tmp_path, name, content, needles):
    path = tmp_path / "plan.yaml"
    if content is not None:
        write(path, content)
    one_line(*run_cli("capture", "--plan", path), 2, f"plan {path}", *needles)


PLAN_FIELD_CASES = [
    ("pools-not-bytes", lambda d: d["pools"].update(shared="lots"),
     ["pool 'shared' must have a byte count, got 'lots'"]),
    ("pool-unknown", lambda d: d.update(pool="everything"),
     ["field 'pool' must be one of shared, per_scope, per_entry, none"]),
    ("key-batch", lambda d: d["key"].update(batch="two"),
     ["key.batch must be a positive integer, got 'two'"]),
    ("key-world", lambda d: d["key"].update(world=[2]), ["key.world must be a positive integer"]),
    ("layer-outside", lambda d: d["layers"][1].update(layer=5),
     ["layer 5 is not a layer of tiny-qwen3-moe (0..1)"]),
    ("layer-twice", lambda d: d["layers"][1].update(layer=0), ["layer 0 appears twice"]),
    ("scopes", lambda d: d["layers"][0].update(scopes="attn"),
     ["layer 0 has scopes 'attn'; expected a list of attn, moe"]),
    ("groups-not-mapping", lambda d: d["layers"][0].update(groups=["shared"]),
     ["layer 0 has groups ['shared']; expected a mapping"]),
    ("groups-scope", lambda d: d["layers"][0]["groups"].update({"layers.1.attn": "shared"}),
     ["layer 0 groups scope 'layers.1.attn', which is not one of its scopes"]),
    ("peak-bool", lambda d: d.update(predicted_peak=True),
     ["field 'predicted_peak' must be a byte count, got True"]),
    ("other-run", lambda d: d["key"].update(seq_len=1024),
     ["was made for tiny-qwen3-moe", "seq_len 1024", "not this run", "run `moegraph plan` again"]),
    ("other-ranks", lambda d: d["key"].update(world=2, ep=2),
     ["was made for --nproc 2 --ep 2, not this run's one process"]),
]


@NO_CUDA
@pytest.mark.parametrize("name,edit,needles", PLAN_FIELD_CASES,
                         ids=[c[0] for c in PLAN_FIELD_CASES])
def test_capture_plan_fields_checked_before_the_device(good_plan, name, edit, needles):
    _edit_plan(good_plan, edit)
    one_line(*run_cli("capture", "--plan", good_plan), 2, f"plan {good_plan}", *needles)


def test_plan_field_errors_name_the_line(good_plan):
    _edit_plan(good_plan, lambda d: d["pools"].update(shared="lots"))
    line = next(i for i, text in enumerate(good_plan.read_text().splitlines(), 1)
                if "shared: lots" in text)
    one_line(*run_cli("capture", "--plan", good_plan), 2,
             f"plan {good_plan}:{line}: pool 'shared'")


@NO_CUDA
def test_capture_good_plan_reaches_the_device(good_plan):
    one_line(*run_cli("capture", "--plan", good_plan, "--memory-limit", "40GiB"), 4,
             "no CUDA device")


def _savings(key, **extra):
    return {"moegraph_savings": 1, "key": key,
            "scopes": {"layers.0.attn": {"saved_ms": 0.5}}, **extra}


SAVINGS_CASES = [
    ("binary", b"\xc3\x28", ["not a text file"]),
    ("list", "[1, 2]", ["not a moegraph savings file: expected a mapping", "got a list"]),
    ("empty", "", ["the file is empty; expected a moegraph savings file"]),
    ("key-list", {"moegraph_savings": 1, "key": [1], "scopes": {}},
     ["key must be a mapping of the run's batch"]),
    ("saved-ms", "scopes", ["scope 'layers.0.attn' has no numeric saved_ms"]),
    ("per-kind", "per_kind", ["per_kind must be a mapping of scope kind to saved_ms"]),
]


@pytest.mark.parametrize("name,content,needles", SAVINGS_CASES, ids=[c[0] for c in SAVINGS_CASES])
def test_plan_bad_savings_file(tmp_path, name, content, needles):
    key = run_key(resolve().profile)
    if content == "scopes":
        content = _savings(key, scopes={"layers.0.attn": {"saved_ms": "fast"}})
    elif content == "per_kind":
        content = _savings(key, per_kind=[1])
    if isinstance(content, dict):
        content = json.dumps(content)
    path = write(tmp_path / "s.json", content)
    one_line(*run_cli("plan", "--budget", "1.5GiB", "--savings", path), 2, f"savings {path}",
             *needles)


CALIBRATION_CASES = [
    ("binary", b"\xff" * 4, ["not a text file"]),
    ("string", "calibration\n", ["not a moegraph calibration file: expected a mapping",
                                 "the string 'calibration'"]),
    ("entries", "moegraph_calibration: 1\nentries: {}\n",
     ["c.yaml:2: entries must be a list, got {}"]),
    ("entry", "moegraph_calibration: 1\nentries: [3]\n", ["c.yaml:2: entry 0 must be a mapping with a key and scopes"]),
    ("scope", "moegraph_calibration: 1\nentries:\n- key: {}\n  scopes: {attn: 3}\n",
     ["c.yaml:4: entry 0 scope attn must be a mapping of byte counts, got 3"]),
    ("pools", "moegraph_calibration: 1\nentries:\n- key: {}\n  scopes:\n    attn:\n"
              "      saved_bytes: 1\n      out_bytes: 1\n      fwd_peak_bytes: 1\n"
              "      bwd_peak_bytes: 1\n      private_pools: [1]\n",
     ["c.yaml:10: entry 0 scope attn private_pools must be [forward bytes, backward bytes]"]),
    ("key", "moegraph_calibration: 1\nentries:\n- key: {batch: 2}\n  scopes: {}\n",
     ["c.yaml:3: entry 0 key has no 'seq_len'"]),
]


@pytest.mark.parametrize("name,content,needles", CALIBRATION_CASES,
                         ids=[c[0] for c in CALIBRATION_CASES])
def test_plan_bad_calibration_file(tmp_path, name, content, needles):
    path = write(tmp_path / "c.yaml", content)
    one_line(*run_cli("plan", "--budget", "1.5GiB", "--calibration", path), 2,
             f"calibration {path}", *needles)


# -- run.data -----------------------------------------------------------------------------
def _tokens(tmp_path, name, value):
    path = tmp_path / name
    if isinstance(value, bytes):
        path.write_bytes(value)
    else:
        torch.save(value, path)
    return path


TOKEN_CASES = [
    ("negative", "t.pt", torch.tensor([5, -3] * 600), ["holds the negative token id -3",
                                                       "token ids are 0..31999"]),
    ("too-large", "t.pt", torch.tensor([5, 32000] * 600), ["holds token id 32000 >= vocab_size"]),
    ("float", "t.pt", torch.rand(1200), ["must hold an integer tensor of token ids, not a "
                                         "torch.float32 tensor"]),
    ("bool", "t.pt", torch.ones(1200, dtype=torch.bool), ["not a torch.bool tensor"]),
    ("dict", "t.pt", {"ids": torch.arange(1200)}, ["not a dict"]),
    ("garbage-pt", "t.pt", b"not a zip file at all", ["is not a file written by torch.save"]),
    ("zip-garbage", "t.pt", b"PK\x03\x04garbage", ["cannot be loaded by torch.load",
                                                    "not a ZIP archive"]),
    ("pickled-set", "t.pt", pickle.dumps({1, 2}), ["it holds Python objects besides tensors"]),
    ("short", "t.pt", torch.arange(10), ["has 10 tokens; one batch needs 1024"]),
    ("odd-bin", "t.bin", b"\x01\x00\x02", ["odd byte count; expected raw uint16 ids"]),
    ("empty-bin", "t.bin", b"", ["has 0 tokens; one batch needs 1024"]),
    ("suffix", "t.npy", b"\x00\x00", ["must be .pt (tensor of ids) or .bin (raw uint16 ids)"]),
]


@NO_CUDA
@pytest.mark.parametrize("cmd", ["capture", "verify", "profile"])
@pytest.mark.parametrize("name,file,value,needles", TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_bad_token_file_before_the_device(tmp_path, cmd, name, file, value, needles):
    path = _tokens(tmp_path, file, value)
    one_line(*run_cli(cmd, "--set", f"run.data={path}"), 2, f"run.data: {path}", *needles)


@NO_CUDA
def test_missing_token_file(tmp_path):
    one_line(*run_cli("capture", "--set", f"run.data={tmp_path / 'none.pt'}"), 2,
             f"run.data: token file {tmp_path / 'none.pt'} does not exist")
    one_line(*run_cli("verify", "--set", f"run.data={tmp_path}"), 2, "is not a regular file")


@NO_CUDA
def test_good_token_file_reaches_the_device(tmp_path):
    path = _tokens(tmp_path, "t.pt", torch.arange(2048) % 32000)
    one_line(*run_cli("capture", "--set", f"run.data={path}"), 4, "no CUDA device")


# -- the GPU commands' options, before the device -------------------------------------------
OPTION_CASES = [
    (["capture", "--memory-limit", "12XB"], ["--memory-limit '12XB' is not a size"]),
    (["capture", "--memory-limit", "0"], ["--memory-limit '0'"]),
    (["capture", "--steps", "0"], ["--steps must be positive, got 0"]),
    (["capture", "--warmup", "-1"], ["--warmup must be >= 0, got -1"]),
    (["verify", "--steps", "0"], ["--steps must be positive, got 0"]),
    (["profile", "--steps", "-2"], ["--steps must be positive, got -2"]),
    (["capture", "--set", "model=3"], ["model is a section, not a field"]),
    (["profile", "--profile", "nope"], ["profile 'nope' not found"]),
]


@NO_CUDA
@pytest.mark.parametrize("args,needles", OPTION_CASES, ids=[" ".join(c[0]) for c in OPTION_CASES])
def test_gpu_command_options_before_the_device(args, needles):
    one_line(*run_cli(*args), 2, *needles)


@NO_CUDA
@pytest.mark.parametrize("cmd", ["capture", "verify", "profile"])
def test_refused_setting_before_the_device(cmd):
    one_line(*run_cli(cmd, "--set", "run.fp8=true"), 4, "run.fp8=true", "not supported")


@NO_CUDA
@pytest.mark.parametrize("cmd", ["capture", "verify", "profile"])
def test_good_inputs_reach_the_device(cmd):
    one_line(*run_cli(cmd, "--set", "run.seq_len=256"), 4, "no CUDA device")
