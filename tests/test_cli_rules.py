"""One rule per input, stated once: a key written twice in a YAML or JSON file is an error naming
it and its line (a checkpoint's shard index and safetensors headers too); each number has one
bound (config/fields.py BOUNDS) at every entry point; non-finite weights are refused as they
load (and, seeded, by `verify` before it compares); and the small things the tables
print (shapes that never wrap, `moe.mode`, the I/O line's sign). Each error case asserts the
exit code, that stderr is one line, and that nothing was left behind."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_util import TINY_SET, one_line, run_cli, tiny_checkpoint
from moegraph_cli.config.fields import BOUNDS, MAX_INT, MAX_SEED
from moegraph_cli.plan.runkey import run_key
from moegraph_cli.report import render
from moegraph_cli.train.runspec import resolve

REPO = Path(__file__).resolve().parents[1]
CPU = ["--set", "run.device=cpu", "--set", "run.seq_len=32"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def _listing(path: Path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def ckpt(tmp_path):
    return tiny_checkpoint(tmp_path / "ck", "--json")


# -- 2. a key twice ----------------------------------------------------------------------------
PROFILE_DUPLICATES = [
    ("section", "run:\n  batch: 1\nmodel: {}\nrun:\n  seq_len: 64\n",
     "p.yaml:4:1: not valid YAML: duplicate key 'run' (first at line 1)"),
    ("field", "run:\n  batch: 1\n  seq_len: 64\n  batch: 2\n",
     "p.yaml:4:3: not valid YAML: duplicate key 'batch' (first at line 2)"),
    ("flow", "run: {batch: 1, batch: 2}\n", "p.yaml:1:17: not valid YAML: duplicate key 'batch'"),
    ("top-level name", "name: a\nname: b\n", "p.yaml:2:1: not valid YAML: duplicate key 'name'"),
]


@pytest.mark.parametrize("name,text,needle", PROFILE_DUPLICATES,
                         ids=[c[0] for c in PROFILE_DUPLICATES])
def test_a_profile_key_twice(tmp_path, name, text, needle):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    one_line(*run_cli("inspect", "--profile", path), 2, f"profile {path}", needle)
    assert _listing(tmp_path) == ["p.yaml"]


def test_a_merge_key_may_be_overridden(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("run:\n  <<: {batch: 1, seq_len: 64}\n  batch: 3\n")
    code, out, err = run_cli("inspect", "--profile", path, "--json")
    assert code == 0, err
    assert json.loads(out)["run"]["batch"] == 3 and json.loads(out)["run"]["seq_len"] == 64


def test_a_plan_key_twice(tmp_path):
    plan = tmp_path / "plan.yaml"
    code, _, err = run_cli("plan", "--budget", "1.5GiB", "--out", plan)
    assert code == 0, err
    text = plan.read_text()
    plan.write_text(text + "pool: shared\n")  # `pool:` is already in the file
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("pool:"))
    last = len(text.splitlines()) + 1
    one_line(*run_cli("capture", "--plan", plan), 2, f"plan {plan}:{last}:1: not valid YAML: "
             f"duplicate key 'pool' (first at line {first})")


def test_a_savings_json_key_twice(tmp_path):
    key = json.dumps(run_key(resolve().profile))
    path = tmp_path / "s.json"
    path.write_text('{"moegraph_savings": 1,\n "key": ' + key + ',\n "scopes": {},\n'
                    ' "scopes": {}}\n')
    one_line(*run_cli("plan", "--budget", "1.5GiB", "--savings", path), 2,
             f"savings {path}:4:", "duplicate key 'scopes' (first at line 3)")


def test_a_calibration_key_twice(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("moegraph_calibration: 1\nentries: []\nentries: []\n")
    one_line(*run_cli("plan", "--budget", "1.5GiB", "--calibration", path), 2,
             f"calibration {path}:3:1: not valid YAML/JSON: duplicate key 'entries' (first at "
             "line 2)")


def test_a_config_json_key_twice(ckpt):
    path = ckpt / "config.json"
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"hidden_size"' in line)
    lines.insert(at + 1, '  "hidden_size": 64,')
    path.write_text("\n".join(lines))
    one_line(*run_cli("inspect", ckpt), 2, f"{path}: invalid JSON (duplicate key "
             f"'hidden_size' at line {at + 2})")


@pytest.mark.parametrize("where", ["weight_map", "top level"])
def test_a_shard_index_key_twice(tmp_path, where):
    from moegraph_cli.io.hf_names import INDEX_FILE

    d = tmp_path / "ck"
    code, _, err = run_cli("init", "tiny-qwen3-moe", d, *TINY_SET, "--max-shard-size", "20KB",
                           "--json")
    assert code == 0, err
    path = d / INDEX_FILE
    lines = path.read_text().splitlines()
    if where == "weight_map":  # the same tensor in two files: which one would load?
        at = next(i for i, line in enumerate(lines) if '"model.norm.weight"' in line)
        lines.insert(at, '    "model.norm.weight": "model-00001-of-00002.safetensors",')
        key, second = "model.norm.weight", at + 2  # the line the key moved to, 1-based
    else:
        at = next(i for i, line in enumerate(lines) if '"weight_map"' in line)
        lines.insert(at, '  "metadata": {"total_size": 1},')
        key, second = "metadata", at + 1  # the inserted line, after the first metadata
    path.write_text("\n".join(lines) + "\n")
    before = _listing(tmp_path)
    one_line(*run_cli("inspect", d), 1, f"checkpoint: {INDEX_FILE} is not valid JSON "
             f"(duplicate key '{key}' at line {second})")
    assert _listing(tmp_path) == before


def test_a_safetensors_header_tensor_twice(ckpt):
    """Two entries for one name: safetensors' reader would keep one silently."""
    import struct

    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    entry = json.dumps({"model.norm.weight": header["model.norm.weight"]},
                       separators=(",", ":"))
    text = raw[8:8 + n].decode().rstrip()
    doubled = (entry[:-1] + "," + text[1:]).encode()
    path.write_bytes(struct.pack("<Q", len(doubled)) + doubled + raw[8 + n:])
    for cmd in (["inspect", ckpt], ["verify", "-c", ckpt, *CPU, "--steps", "1"]):
        one_line(*run_cli(*cmd), 1, "checkpoint: model.safetensors has a corrupt header: key "
                 "model.norm.weight appears twice")


def test_the_shipped_profiles_have_no_key_twice():
    from moegraph_cli.config import load_profile, profile_names

    for name in profile_names():
        load_profile(name)  # raises on a duplicate


# -- 3. one bound per number, the same at every entry point --------------------------------
def test_the_seed_rule_is_one_range_everywhere(tmp_path):
    assert (BOUNDS["run.seed"].low, BOUNDS["run.seed"].high) == (0, MAX_SEED) == (0, 2**32 - 1)
    rule = "must be in 0..4294967295"
    for value in (-1, 2**32):
        one_line(*run_cli("inspect", "--set", f"run.seed={value}"), 2,
                 f"run.seed {rule}, got {value}")
        one_line(*run_cli("init", "tiny-qwen3-moe", tmp_path / "ck", "--seed", value,
                          *TINY_SET), 2, f"--seed {rule}, got {value}")
        path = tmp_path / "p.yaml"
        path.write_text(f"run:\n  seed: {value}\n")
        one_line(*run_cli("inspect", "-p", path), 2, f"p.yaml:2: run.seed {rule}")
        path.unlink()
    assert _listing(tmp_path) == []
    code, _, err = run_cli("inspect", "--set", "run.seed=3000000000")  # above 2**31: a seed
    assert code == 0, err
    code, out, err = run_cli("init", "tiny-qwen3-moe", tmp_path / "ck", "--seed", MAX_SEED,
                             *TINY_SET, "--json")
    assert code == 0 and json.loads(out)["seed"] == MAX_SEED, err


@NO_CUDA
@pytest.mark.parametrize("value, words", [("nan", "--tolerance must be a finite number, got nan"),
                                          ("inf", "--tolerance must be a finite number, got inf"),
                                          ("-0.5", "--tolerance must be >= 0, got -0.5")])
def test_verify_tolerance_refused_before_any_work(value, words):
    # exit 2, not 4: refused before the device is looked for
    one_line(*run_cli("verify", "--no-lr0", "--tolerance", value), 2, words)


@pytest.mark.parametrize("cmd", ["capture", "profile", "verify", "plan"])
@pytest.mark.parametrize("args, words", [
    (["--nproc", "1025"], "--nproc 1025 is too large (at most 1024)"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--nproc", "2", "--ep", "0"], "--ep must be at least 1, got 0"),
    (["--nproc", "2", "--ep", "2048"], "--ep 2048 is too large (at most 1024)"),
])
def test_ranks_have_one_bound(cmd, args, words):
    extra = ["--budget", "4GiB"] if cmd == "plan" else []
    one_line(*run_cli(cmd, *args, *extra), 2, words)


@pytest.mark.parametrize("args, words", [
    (["capture", "--steps", str(MAX_INT + 1)], f"--steps {MAX_INT + 1} is too large (at most "
                                               f"{MAX_INT})"),
    (["capture", "--warmup", str(MAX_INT + 1)], "--warmup 2147483648 is too large"),
    (["profile", "--steps", "0"], "--steps must be positive, got 0"),
    (["inspect", "--set", f"run.steps={MAX_INT + 1}"], "run.steps 2147483648 is too large"),
])
def test_steps_have_one_bound(args, words):
    one_line(*run_cli(*args), 2, words)


def test_the_help_states_the_bounds():
    code, out, _ = run_cli("init", "--help")
    assert "Weight seed, 0..4294967295" in " ".join(out.split())
    for cmd in ("plan", "capture"):
        code, out, _ = run_cli(cmd, "--help")
        assert "(1..1024" in " ".join(out.split())


# -- 4. non-finite weights ------------------------------------------------------------------
def _poison(file: Path, tensor: str, index, value) -> None:
    tensors = load_file(file)
    tensors[tensor][index] = value
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("tensor, index, value, what", [
    ("model.layers.1.mlp.experts.3.up_proj.weight", (2, 5), float("nan"), "nan at [2, 5]"),
    ("model.norm.weight", (7,), float("-inf"), "-inf at [7]"),
])
def test_a_non_finite_weight_is_named_as_it_loads(ckpt, tensor, index, value, what):
    """Found by the load, before verify compares anything: the HF name, its file and the
    place on disk (the up_proj rows land in w_gate_up[3, 16 + 2, 5] after loading)."""
    _poison(ckpt / "model.safetensors", tensor, index, value)
    before = _listing(ckpt.parent)
    one_line(*run_cli("verify", "-c", ckpt, *CPU, "--steps", "1"), 1,
             f"checkpoint: tensor {tensor} in model.safetensors is not finite ({what})")
    assert _listing(ckpt.parent) == before


def test_every_command_loads_through_the_check(tmp_path):
    """capture and profile need CUDA (exit 4 before loading on this machine); they build their
    model where verify does, runspec.build_model, which refuses the weights here. A sharded
    checkpoint's message names the shard."""
    from moegraph_cli.errors import CheckpointError
    from moegraph_cli.io.hf_names import INDEX_FILE
    from moegraph_cli.train.runspec import build_model

    d = tmp_path / "ck"
    code, _, err = run_cli("init", "tiny-qwen3-moe", d, *TINY_SET, "--max-shard-size", "20KB",
                           "--json")
    assert code == 0, err
    tensor = "model.layers.1.self_attn.k_proj.weight"
    shard = json.loads((d / INDEX_FILE).read_text())["weight_map"][tensor]
    _poison(d / shard, tensor, (1, 4), float("inf"))
    spec = resolve(None, str(d), [])
    with pytest.raises(CheckpointError) as e:
        build_model(spec, torch.device("cpu"))
    assert str(e.value) == f"checkpoint: tensor {tensor} in {shard} is not finite (inf at [1, 4])"
    assert e.value.exit_code == 1


def test_a_weight_that_overflows_the_load_dtype(ckpt):
    from moegraph_cli.errors import CheckpointError
    from moegraph_cli.io.checkpoint import load_state_dict

    _poison(ckpt / "model.safetensors", "model.norm.weight", (3,), 1e5)  # float16 tops at 65504
    cfg = resolve(None, str(ckpt), []).profile.model
    assert load_state_dict(ckpt, cfg, check_finite=True)["norm.weight"][3] == 1e5
    with pytest.raises(CheckpointError) as e:
        load_state_dict(ckpt, cfg, dtype=torch.float16, check_finite=True)
    assert str(e.value) == ("checkpoint: tensor model.norm.weight in model.safetensors is not "
                            "finite once cast to float16 (inf at [3])")
    assert torch.isinf(load_state_dict(ckpt, cfg, dtype=torch.float16)["norm.weight"][3])


def test_verify_refuses_an_initializer_range_that_would_overflow_the_seeded_weights():
    """An initializer_range so large that N(0, std) overflows float32 is refused as config,
    before any weight is drawn (verify's own non-finite check: test_first_non_finite)."""
    one_line(*run_cli("verify", *TINY_SET, *CPU, "--set", "model.initializer_range=1e39",
                      "--steps", "1"), 2,
             "model.initializer_range must be in [0, 1] (the standard deviation of the seeded "
             "init's weights), got 1e+39")


def test_first_non_finite():
    from moegraph_cli.models.common.finite import first_non_finite

    good = {"a": torch.ones(3), "ids": torch.arange(4), "empty": torch.zeros(0)}
    assert first_non_finite(good.items()) is None
    bad = {**good, "b": torch.tensor([[1.0, 2.0], [float("inf"), float("nan")]]),
           "c": torch.tensor([float("nan")])}
    assert first_non_finite(bad.items()) == ("b", "inf at [1, 0]")
    huge = {"f64": torch.full((3,), 1e300, dtype=torch.float64),  # beyond float32: finite
            "f32": torch.full((5,), torch.finfo(torch.float32).max),  # a sum would overflow
            "bf16": torch.tensor([0.0, -3e38], dtype=torch.bfloat16)}
    assert first_non_finite(huge.items()) is None
    huge["f16"] = torch.tensor([1.0, float("-inf"), 2.0], dtype=torch.float16)
    assert first_non_finite(huge.items()) == ("f16", "-inf at [1]")


# -- 7. what the tables print ----------------------------------------------------------------
def test_inspect_shapes_never_wrap_inside_a_shape():
    done = subprocess.run([sys.executable, "-m", "moegraph_cli.app", "inspect", "-p",
                           "qwen3-30b-a3b"], capture_output=True, text=True, cwd=REPO,
                          env={"COLUMNS": "60", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "w_gate_up[128, 1536, 2048]" in done.stdout
    for line in done.stdout.splitlines():  # every shape's brackets close on its line
        assert line.count("[") == line.count("]"), line


def test_inspect_names_moe_settings_as_set_does():
    code, out, _ = run_cli("inspect", "--set", "moe.mode=capacity")
    assert code == 0
    assert re.search(r"moe\.mode\s.*capacity", out) and "moe.capacity_factor" in out
    assert "run.moe_mode" not in out and "run.capacity_factor" not in out
    code, out, _ = run_cli("inspect", "--json")
    assert json.loads(out)["moe"] == {"mode": "dropless", "capacity_factor": None}


def test_plan_io_line_has_one_sign():
    code, out, err = run_cli("plan", "--budget", "4GiB")
    assert code == 0, err
    line = next(line for line in out.splitlines() if "- I/O buffers" in line)
    value = line.split("\u2502")[-2].strip()
    assert re.fullmatch(r"\d+(\.\d\d)? [KMGT]?i?B", value), line
    assert "- -" not in out


def test_verify_says_no_gradient_differs_not_dash(capsys):
    result = {"profile": "p", "lr": 0.0, "scopes": ["attn", "moe"], "eager_losses": [1.0],
              "graph_losses": [1.0], "grad_max_abs": 0.0, "grad_worst": "-", "passed": True,
              "verdict": "ok", "counters": {"captured": 1, "replayed": 1, "fallback": 0}}
    render.verify_result(result, False)
    out = capsys.readouterr().out
    assert "gradient max-abs difference: 0 (no gradient differs)" in out
    assert "(largest in -)" not in out
    render.verify_result({**result, "grad_max_abs": 0.5, "grad_worst": "layers.0.x"}, False)
    assert "0.5 (largest in layers.0.x)" in capsys.readouterr().out


@NO_CUDA
def test_verify_without_cuda_says_how_to_run_on_a_cpu():
    one_line(*run_cli("verify"), 4, "no CUDA device", "verify also runs on a CPU",
             "--set run.device=cpu")


# -- 8. matplotlib is an extra the tests pull in ----------------------------------------------
def test_matplotlib_is_the_plot_extra_and_in_test():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["plot"] == ["matplotlib"] and "matplotlib" in extras["test"]
    assert not any("matplotlib" in d for d in tomllib.loads(
        (REPO / "pyproject.toml").read_text())["project"]["dependencies"])
