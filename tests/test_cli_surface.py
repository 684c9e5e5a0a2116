"""The CLI's surface (issue 12): parser errors as one line, no stray stderr, never writing where
not asked, `init` streaming, consistent output, help, a profile with a checkpoint, start-up
without torch. Each error case checks the exit code, that stderr is one line, and the words
that name the problem."""

import re
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_util import TINY, TINY_SET, run_cli
from moegraph_cli.commands import create as create_mod
from moegraph_cli.io.checkpoint import load_state_dict
from moegraph_cli.io.checkpoint_save import save_checkpoint
from moegraph_cli.config import profile_names
from moegraph_cli.commands.create import create_checkpoint
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.io.outputs import file_mode, write_atomically
from moegraph_cli.train.runspec import resolve
from moegraph_cli.units import fmt_bytes, parse_bytes

REPO = Path(__file__).resolve().parents[1]


def one_line(code, out, err, expected_code, *needles, prefix="moegraph: error: "):
    assert code == expected_code, (code, out, err)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in out + err and "\u256d" not in err  # no rich box
    return lines[0]


def run_process(*args, env=None, prelude=""):
    """The real `moegraph` entry point in a fresh interpreter: (code, stdout, stderr)."""
    code = (f"import sys\n{prelude}\nsys.argv = ['moegraph', *sys.argv[1:]]\n"
            "from moegraph_cli.app import main\nmain()\n")
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, **(env or {})}, timeout=120)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ck"
    code, out, err = run_cli("init", "tiny-qwen3-moe", d, *TINY_SET, "--json")
    assert code == 0 and err == "", err
    return d


# -- 1. the argument parser: one line, exit 2, a pointer to --help ----------------------------
@pytest.mark.parametrize("args, words", [
    (["bogus"], ["no such command 'bogus'", "(see moegraph --help)"]),
    (["plan", "--bogus"], ["no such option: --bogus", "(see moegraph plan --help)"]),
    (["init", "tiny-qwen3-moe"], ["missing argument 'DIR'", "(see moegraph init --help)"]),
    (["init"], ["missing argument 'PROFILE'"]),
    (["capture", "--steps", "x"], ["'--steps'", "(see moegraph capture --help)"]),
    (["plan", "--nproc", "two"], ["'--nproc'"]),
    (["verify", "--tolerance", "tight"], ["'--tolerance'"]),
    (["inspect", "--json", "extra", "args"], ["unexpected extra argument"]),
])
def test_parser_errors_are_one_line(args, words):
    one_line(*run_cli(*args), 2, *words)


def test_parser_error_from_the_installed_entry_point():
    one_line(*run_process("plan", "--budgett", "4GiB"), 2, "no such option: --budgett",
             "(see moegraph plan --help)")


def test_bare_moegraph_prints_help():
    code, out, err = run_cli()
    assert code == 0 and "Usage: moegraph" in out and err == ""


# -- 2. no stray stderr -----------------------------------------------------------------------
def test_torch_without_numpy_prints_nothing(tmp_path):
    """torch warns "Failed to initialize NumPy" when numpy is missing; moegraph silences that
    one warning (see moegraph_cli/__init__.py). numpy is blocked here as if not installed."""
    code, out, err = run_process("init", "tiny-qwen3-moe", tmp_path / "ck", *TINY_SET, "--json",
                                 prelude="sys.modules['numpy'] = None")
    assert code == 0, err
    assert err == "", err
    assert json.loads(out)["files"] == ["config.json", "model.safetensors"]


def test_only_the_numpy_warning_is_filtered():
    code = ("import warnings, moegraph_cli\n"
            "warnings.warn('Failed to initialize NumPy: No module named numpy', UserWarning)\n"
            "warnings.warn('something else', UserWarning)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert "something else" in done.stderr and "NumPy" not in done.stderr, done.stderr


# -- 3. never write where not asked -----------------------------------------------------------
def test_plan_out_missing_parent(tmp_path):
    target = tmp_path / "new" / "deeper" / "plan.yaml"
    one_line(*run_cli("plan", "--budget", "4GiB", "--out", target), 2,
             f"directory {target.parent} does not exist", "--mkdir")
    assert not (tmp_path / "new").exists()


def test_plan_out_mkdir(tmp_path):
    target = tmp_path / "new" / "plan.yaml"
    code, out, err = run_cli("plan", "--budget", "4GiB", "--out", target, "--mkdir", "--json")
    assert code == 0, err
    assert target.is_file() and "moegraph_plan: 1" in target.read_text()
    assert sorted(p.name for p in target.parent.iterdir()) == ["plan.yaml"]  # no temp left


def test_plan_out_is_a_directory(tmp_path):
    one_line(*run_cli("plan", "--budget", "4GiB", "--out", tmp_path), 2,
             f"--out {tmp_path} is a directory")


def test_plan_out_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    one_line(*run_cli("plan", "--budget", "4GiB", "--out", tmp_path / "f" / "plan.yaml"), 2,
             f"{tmp_path / 'f'} is not a directory")


@pytest.mark.parametrize("flag", ["--out", "--plot", "--calibrate"])
def test_profile_outputs_checked_before_the_device(tmp_path, flag):
    one_line(*run_cli("profile", flag, tmp_path / "missing" / "x.yaml"), 2,
             f"{flag} {tmp_path / 'missing' / 'x.yaml'}: directory", "--mkdir")
    one_line(*run_cli("profile", flag, tmp_path), 2, f"{flag} {tmp_path} is a directory")


def test_init_missing_parent(tmp_path):
    target = tmp_path / "a" / "b" / "ck"
    one_line(*run_cli("init", "tiny-qwen3-moe", target, *TINY_SET), 2,
             f"directory {target.parent} does not exist", "--mkdir")
    assert not (tmp_path / "a").exists()
    code, out, err = run_cli("init", "tiny-qwen3-moe", target, *TINY_SET, "--mkdir", "--json")
    assert code == 0 and (target / "config.json").is_file(), err


def test_init_into_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    one_line(*run_cli("init", "tiny-qwen3-moe", tmp_path / "f", *TINY_SET), 2,
             f"init: {tmp_path / 'f'} is a file, not a directory")
    assert (tmp_path / "f").read_text() == "x"


def test_interrupted_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "plan.yaml"
    target.write_text("old")

    def half(tmp):
        tmp.write_text("half a fi")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, half)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["plan.yaml"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_files_have_the_mode_of_config_json(tmp_path, umask):
    old = os.umask(umask)
    try:
        code, _, err = run_cli("init", "tiny-qwen3-moe", tmp_path / "ck", *TINY_SET,
                               "--max-shard-size", "20KB", "--json")
        assert code == 0, err
        assert file_mode() == 0o666 & ~umask
    finally:
        os.umask(old)
    files = sorted((tmp_path / "ck").iterdir())
    assert len(files) > 3  # shards, index, config.json
    want = stat.S_IMODE(os.stat(tmp_path / "ck" / "config.json").st_mode)
    assert want == 0o666 & ~umask
    assert {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in files} == \
        {f.name: want for f in files}


# -- 4. init streams ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_init_is_bitwise_from_config(tmp_path, dtype, monkeypatch):
    """One tensor at a time, never the model, and the very bytes save_checkpoint writes for
    MoeCausalLM.from_config with the same seed, sharded into several files."""
    spec = resolve("tiny-qwen3-moe", None, TINY + [
        f"run.dtype={dtype}", "model.num_hidden_layers=3", "model.mlp_only_layers=[1]"])
    prof = spec.profile
    model = MoeCausalLM.from_config(prof.model, prof.moe, 11, prof.run.dtype, "cpu")
    save_checkpoint(model.state_dict(), prof.model, tmp_path / "whole", max_shard_bytes=30_000)

    def no_model(*args, **kwargs):
        raise AssertionError("init built the model")

    monkeypatch.setattr(MoeCausalLM, "from_config", no_model)
    monkeypatch.setattr(MoeCausalLM, "__init__", no_model)
    result = create_checkpoint(spec, tmp_path / "streamed", seed=11, max_shard_bytes=30_000)
    whole = sorted((tmp_path / "whole").iterdir())
    streamed = sorted((tmp_path / "streamed").iterdir())
    assert len(streamed) >= 5 and result["files"] == [p.name for p in whole]
    for a, b in zip(whole, streamed):
        assert a.read_bytes() == b.read_bytes(), a.name
    state = load_state_dict(tmp_path / "streamed", prof.model)
    for name, want in model.state_dict().items():
        assert torch.equal(state[name].view(torch.uint8), want.view(torch.uint8)), name
    assert result["params"] == sum(t.numel() for t in model.state_dict().values())


def test_streamed_file_is_what_safetensors_writes(tmp_path):
    from safetensors.torch import save_file

    from moegraph_cli.io.checkpoint_save import _write_safetensors

    tensors = {"b.w": torch.randn(3, 5), "a.x": torch.randn(7), "a.10": torch.randn(2, 2),
               "a.9": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    _write_safetensors(tmp_path / "mine.safetensors", [(k, tuple(v.shape)) for k, v in
                                                       tensors.items()], "F32",
                       tensors.__getitem__, None)
    assert (tmp_path / "mine.safetensors").read_bytes() == \
        (tmp_path / "ref.safetensors").read_bytes()


def test_init_checks_free_disk_space(tmp_path, monkeypatch):
    import shutil as real

    monkeypatch.setattr(create_mod.shutil, "disk_usage",
                        lambda p: real._ntuple_diskusage(10**12, 10**12 - 4096, 4096))
    line = one_line(*run_cli("init", "tiny-qwen3-moe", tmp_path / "ck", *TINY_SET), 1,
                    "init: the checkpoint needs", "4.00 KiB free")
    assert str(tmp_path) in line and not (tmp_path / "ck").exists()


def _failing_after(n, exc):
    real = create_mod.seeded_tensors

    def seeded_tensors(cfg, seed, dtype):
        tensor_of, calls = real(cfg, seed, dtype), [0]

        def failing(name):
            calls[0] += 1
            if calls[0] > n:
                raise exc
            return tensor_of(name)

        return failing

    return seeded_tensors


@pytest.mark.parametrize("exc, words", [
    (MemoryError(), ["init: out of host memory while generating tensor model.",
                     "removed what it wrote"]),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 1 bytes"), ["out of host memory"]),
    (OSError(28, "No space left on device"), ["init: writing", "No space left on device"]),
])
def test_init_failure_removes_what_it_wrote(tmp_path, monkeypatch, exc, words):
    monkeypatch.setattr(create_mod, "seeded_tensors", _failing_after(40, exc))
    one_line(*run_cli("init", "tiny-qwen3-moe", tmp_path / "new" / "ck", *TINY_SET,
                      "--max-shard-size", "20KB", "--mkdir"), 1, *words)
    assert os.listdir(tmp_path) == []  # the shards, the directories it made: all gone


def test_init_interrupted_removes_what_it_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(create_mod, "seeded_tensors", _failing_after(40, KeyboardInterrupt()))
    spec = resolve("tiny-qwen3-moe", None, TINY)
    (tmp_path / "ck").mkdir()
    with pytest.raises(KeyboardInterrupt):
        create_checkpoint(spec, tmp_path / "ck", max_shard_bytes=20_000)
    assert os.listdir(tmp_path / "ck") == []  # the directory was there before: kept, empty


def test_init_into_a_nonempty_directory_keeps_it(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    one_line(*run_cli("init", "tiny-qwen3-moe", tmp_path, *TINY_SET), 2,
             "exists and is not empty", "--force")
    assert os.listdir(tmp_path) == ["keep.txt"]


# -- 5. consistent, readable output ---------------------------------------------------------------
def test_inspect_folds_identical_layers():
    code, out, _ = run_cli("inspect", "--profile", "qwen3-30b-a3b")
    assert code == 0
    labels = [line.split("\u2502")[1].strip() for line in out.split("layers (identical")[1]
              .splitlines() if line.startswith("\u2502")]
    assert [label for label in labels if label] == ["0\u201347"], labels
    code, out, _ = run_cli("inspect", "--profile", "qwen3-30b-a3b", "--json")
    groups = json.loads(out)["layer_groups"]
    assert [(g["first"], g["last"], g["count"]) for g in groups] == [(0, 47, 48)]


def test_inspect_folds_only_identical_neighbours():
    code, out, _ = run_cli("inspect", *TINY_SET, "--set", "model.num_hidden_layers=5",
                           "--set", "model.mlp_only_layers=[2]", "--json")
    groups = json.loads(out)["layer_groups"]
    assert [(g["first"], g["last"], g["kind"]) for g in groups] == \
        [(0, 1, "moe"), (2, 2, "dense"), (3, 4, "moe")]


@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "qwen3-30b-a3b-12layer"])
def test_inspect_and_plan_report_the_same_static_memory(profile):
    code, out, _ = run_cli("inspect", "-p", profile, "--json")
    static = json.loads(out)["static_memory_bytes"]
    code, out, err = run_cli("plan", "-p", profile, "--budget", "100TiB", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert static["total"] == plan["static_bytes"]
    assert static["buffers"] == plan["static_breakdown"]["buffer_bytes"] > 0
    assert static["total"] == static["weights"] + static["grads"] + static["optimizer"] + \
        static["buffers"]


@pytest.mark.parametrize("pool", ["shared", "per_scope", "per_entry"])
def test_plan_layers_add_up_to_the_pools(pool):
    code, out, err = run_cli("plan", "-p", "qwen3-30b-a3b-4layer", "--budget", "100TiB",
                             "--pool", pool, "--json")
    assert code == 0, err
    r = json.loads(out)
    layers = sum(layer["predicted_bytes"] for layer in r["layers"])
    assert r["layers_bytes"] == layers
    assert layers - r["io_bytes"] + r["pool_working_bytes"] == r["pool_bytes"] == \
        sum(r["pools"].values())
    assert r["pool_working_bytes"] >= 0
    if pool == "per_entry":  # private pools are exactly each scope's own
        assert r["pool_working_bytes"] == 0
    code, out, _ = run_cli("plan", "-p", "qwen3-30b-a3b-4layer", "--budget", "100TiB",
                           "--pool", pool)
    assert "sum of layers" in out and "- I/O buffers" in out and "= graph pools" in out


def test_sizes_in_the_largest_unit():
    assert fmt_bytes(2**40) == "1.00 TiB"
    assert fmt_bytes(102399998976 * 2**30).endswith(" EiB")
    assert fmt_bytes(5 * 2**50) == "5.00 PiB"
    assert fmt_bytes(1023) == "1023 B" and fmt_bytes(-3 * 2**20) == "-3.00 MiB"
    code, out, _ = run_cli("plan", "--budget", "100TiB")
    assert code == 0 and "under 100.00 TiB" in out and re.search(r"\d\.\d\d [MG]iB of budget 100.00 TiB", out)


@pytest.mark.parametrize("text, value", [
    ("80G", 80 * 2**30), ("80GiB", 80 * 2**30), ("80gi", 80 * 2**30), ("80 GiB", 80 * 2**30),
    ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("1.5T", int(1.5 * 2**40)), ("512M", 2**29),
    ("500MB", 5 * 10**8), ("1e9", 10**9), ("4096", 4096), ("2k", 2048), ("3KB", 3000),
])
def test_size_convention(text, value):
    assert parse_bytes(text) == value


def test_size_convention_is_in_the_help():
    for cmd, flag in (("plan", "--budget"), ("init", "--max-shard-size"),
                      ("capture", "--memory-limit")):
        code, out, _ = run_cli(cmd, "--help")
        assert flag in out and "G = GiB = 2^30 bytes, GB = 10^9" in " ".join(out.split())


@pytest.mark.parametrize("budget", ["80X", "lots", "-5G", "0"])
def test_bad_size_is_usage(budget):
    one_line(*run_cli("plan", "--budget", budget), 2, f"--budget '{budget}'")


def test_too_small_budget_is_exit_1():
    one_line(*run_cli("plan", "--budget", "1MiB"), 1, "budget 1.00 MiB is below the static "
             "memory of tiny-qwen3-moe", "310.21 MiB")
    one_line(*run_cli("plan", "--budget", "400MiB"), 1, "does not fit one training step")


def _missing_file_cases(tmp_path, ckpt):
    gone = tmp_path / "gone"
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((ckpt / "config.json").read_text())
    return {
        "checkpoint": (["inspect", gone], "not a directory"),
        "checkpoint -c": (["plan", "-c", gone, "--budget", "4GiB"], "not a directory"),
        "checkpoint config.json": (["inspect", tmp_path], "no config.json"),
        "checkpoint weights": (["inspect", no_weights], "has no model.safetensors"),
        "profile file": (["inspect", "-p", gone / "p.yaml"], "no such file"),
        "plan": (["capture", "--plan", gone / "plan.yaml"], "no such file"),
        "savings": (["plan", "--budget", "4GiB", "--savings", gone / "s.yaml"], "no such file"),
        "calibration": (["plan", "--budget", "4GiB", "--calibration", gone / "c.yaml"],
                        "no such file"),
        "token file": (["verify", "--set", "run.device=cpu", "--set",
                        f"run.data={gone / 't.bin'}"], "does not exist"),
    }


def test_a_missing_file_is_exit_2_whichever_file(tmp_path, ckpt):
    for what, (args, words) in _missing_file_cases(tmp_path, ckpt).items():
        code, out, err = run_cli(*args)
        assert code == 2, (what, code, err)
        one_line(code, out, err, 2, words)


# -- 6. help ------------------------------------------------------------------------------------
def test_version():
    from importlib.metadata import version

    code, out, err = run_cli("--version")
    assert code == 0 and out.strip() == f"moegraph {version('moegraph')}" and err == ""
    assert out.strip() == "moegraph 0.1.0"


@pytest.mark.parametrize("cmd", ["init", "inspect", "plan", "capture", "profile", "verify"])
def test_help_shows_flags_as_flags(cmd):
    code, out, _ = run_cli(cmd, "--help")
    assert code == 0
    assert "<bool>" not in out and "\u256d" not in out
    json_line = next(line for line in out.splitlines() if line.strip().startswith("--json"))
    assert json_line.split()[1] == "Machine-readable"  # no value after the flag


@pytest.mark.parametrize("cmd", ["inspect", "plan", "capture", "profile", "verify"])
def test_every_model_command_takes_checkpoint_and_lists_profiles(cmd):
    code, out, _ = run_cli(cmd, "--help")
    assert "-c, --checkpoint DIR" in out and "-p, --profile" in out
    squeezed = "".join(out.split()).replace("-", "")  # help wraps lines at hyphens
    for name in profile_names():
        assert name.replace("-", "") in squeezed, name


def test_inspect_help_describes_the_profiles():
    code, out, _ = run_cli("inspect", "--help")
    flat = " ".join(out.split())
    assert "Profiles (--profile NAME" in flat
    for name in profile_names():
        assert f"{name}" in flat
    assert "tiny-qwen3-moe (default): Built-in default." in flat


def test_inspect_checkpoint_option_and_positional(ckpt):
    a = run_cli("inspect", ckpt, "--json")
    b = run_cli("inspect", "-c", ckpt, "--json")
    c = run_cli("inspect", "--checkpoint", ckpt, ckpt, "--json")
    assert a[0] == b[0] == c[0] == 0 and a[1] == b[1] == c[1]
    one_line(*run_cli("inspect", ckpt, "-c", ckpt.parent), 2, "give the checkpoint once")


# -- 7. a profile with a checkpoint ----------------------------------------------------------------
def test_profile_with_checkpoint_takes_the_architecture_from_the_checkpoint(ckpt):
    code, out, err = run_cli("inspect", "-c", ckpt, "-p", "qwen3-30b-a3b-4layer", "--json")
    line = one_line(code, out, err, 0, "profile qwen3-30b-a3b-4layer's model section differs "
                    f"from {ckpt / 'config.json'} on", "hidden_size (profile 2048, checkpoint 32)",
                    "the architecture is the checkpoint's", prefix="moegraph: warning: ")
    assert "more" in line
    s = json.loads(out)
    assert s["architecture"]["hidden"] == 32 and s["architecture"]["layers"] == 2
    assert (s["run"]["batch"], s["run"]["seq_len"]) == (1, 1024)  # the profile's run settings
    assert s["run"]["dtype"] == "bfloat16"


def test_profile_with_matching_checkpoint_is_silent(tmp_path):
    import yaml

    base = yaml.safe_load((REPO / "profiles" / "tiny-qwen3-moe.yaml").read_text())
    for item in TINY:
        section_field, value = item.split("=")
        section, field = section_field.split(".")
        base[section][field] = yaml.safe_load(value)
    base["run"]["seq_len"] = 64
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(base))
    code, out, err = run_cli("init", tmp_path / "mine.yaml", tmp_path / "ck", "--json")
    assert code == 0, err
    code, out, err = run_cli("plan", "-c", tmp_path / "ck", "-p", tmp_path / "mine.yaml",
                             "--budget", "4GiB", "--json")
    assert code == 0 and err == "", err
    assert json.loads(out)["key"]["seq_len"] == 64


def test_profile_with_checkpoint_still_refuses_model_overrides(ckpt):
    one_line(*run_cli("inspect", "-c", ckpt, "-p", "tiny-qwen3-moe", "--set",
                      "model.hidden_size=64"), 2, "a checkpoint fixes the model")


# -- 8. commands that need no GPU start without torch --------------------------------------
PROBE = ("import sys, runpy\n"
         "try:\n    runpy.run_module('moegraph_cli.app', run_name='__main__')\n"
         "except SystemExit as e:\n    code = e.code\n"
         "print(code, 'torch' in sys.modules, file=sys.stderr)\n")


@pytest.mark.parametrize("args", [["inspect", "--profile", "tiny-qwen3-moe", "--json"],
                                  ["plan", "--budget", "80GiB", "--json"],
                                  ["plan", "-p", "qwen3-30b-a3b", "--nproc", "8", "--ep", "8",
                                   "--budget", "80G", "--json"],
                                  ["--help"], ["--version"]])
def test_no_torch_import(args):
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "0 False", done.stderr


def test_checkpoint_headers_need_no_torch(ckpt):
    done = subprocess.run([sys.executable, "-c", PROBE, "inspect", str(ckpt), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "0 False", done.stderr
