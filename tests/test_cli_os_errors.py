"""The operating system's errors as one line naming the path, never "internal error": a name or
path too long, a read-only or full file system, /proc and /sys, a stdout that is closed, full
or a broken pipe; for every command and every file it reads or writes. Each case asserts the
exit code (2: another path would do; 1: the run failed), that stderr is one line, and that
nothing was left behind."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_util import one_line, run_cli
from moegraph_cli.io import outputs

REPO = Path(__file__).resolve().parents[1]
LONG = "a" * 300  # one name over NAME_MAX (255 bytes)
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path before CUDA")


def run_process(*args, stdout=subprocess.PIPE, env=None, shell_redirect=None):
    """The real entry point in a fresh interpreter: (code, stdout or "", stderr)."""
    argv = [sys.executable, "-m", "moegraph_cli.app", *map(str, args)]
    if shell_redirect is not None:  # e.g. ">&-": the command's own stdout closed
        argv = ["sh", "-c", f'exec "$@" {shell_redirect}', "sh", *argv]
    done = subprocess.run(argv, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=180)
    return done.returncode, done.stdout or "", done.stderr


def _listing(path: Path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# -- a name the system refuses: every path a command is given ------------------------------
def _long_path_cases(tmp_path):
    long = tmp_path / LONG
    return {
        "inspect DIR": (["inspect", long], [f"{tmp_path}/aaaa", "File name too long"]),
        "plan -c DIR": (["plan", "-c", long, "--budget", "4GiB"], ["File name too long"]),
        "inspect -p FILE": (["inspect", "-p", f"{long}.yaml"],
                            ["profile ", "cannot be read (File name too long)"]),
        "init DIR": (["init", "tiny-qwen3-moe", long], ["init: ", "File name too long"]),
        "init DIR --mkdir": (["init", "tiny-qwen3-moe", long / "ck", "--mkdir"],
                             ["init: ", "File name too long (a name of 300 bytes; at most"]),
        "plan --out": (["plan", "--budget", "4GiB", "--out", f"{long}.yaml"],
                       ["--out ", "File name too long"]),
        "plan --out --mkdir": (["plan", "--budget", "4GiB", "--out", long / "p.yaml",
                                "--mkdir"], ["--out ", "File name too long"]),
        "plan --savings": (["plan", "--budget", "4GiB", "--savings", f"{long}.json"],
                           ["savings ", "File name too long"]),
        "plan --calibration": (["plan", "--budget", "4GiB", "--calibration", f"{long}.yaml"],
                               ["calibration ", "File name too long"]),
        "capture --plan": (["capture", "--plan", f"{long}.yaml"],
                           ["plan ", "File name too long"]),
        "profile --out": (["profile", "--out", f"{long}.json"], ["--out ", "too long"]),
        "profile --plot": (["profile", "--plot", f"{long}.png"], ["--plot ", "too long"]),
        "profile --calibrate": (["profile", "--calibrate", f"{long}.yaml"],
                                ["--calibrate ", "too long"]),
        "verify run.data": (["verify", "--set", f"run.data={long}.pt"], ["File name too long"]),
        "verify -c DIR": (["verify", "-c", long], ["File name too long"]),
    }


@NO_CUDA
@pytest.mark.parametrize("case", list(_long_path_cases(Path("/x"))))
def test_a_name_too_long_is_one_line_exit_2(tmp_path, case):
    args, needles = _long_path_cases(tmp_path)[case]
    one_line(*run_cli(*args), 2, *needles)
    assert _listing(tmp_path) == []


def test_a_path_too_long_as_a_whole(tmp_path):
    deep = tmp_path.joinpath(*["b" * 200] * 25) / "plan.yaml"  # each part fits, the whole not
    one_line(*run_cli("plan", "--budget", "4GiB", "--out", deep, "--mkdir"), 2,
             "--out ", "File name too long (the path has")
    assert _listing(tmp_path) == []


def test_a_long_path_is_shown_cut_but_named(tmp_path):
    line = one_line(*run_cli("inspect", tmp_path / LONG), 2)
    assert str(tmp_path) in line and "..." in line and len(line) < 400


# -- read-only, not ours, pseudo file systems: found before any work --------------------------
@pytest.mark.parametrize("code, reason", [(errno.EROFS, "Read-only file system"),
                                          (errno.EACCES, "Permission denied")])
def test_a_directory_that_takes_no_files_is_refused_up_front(tmp_path, monkeypatch, code,
                                                             reason):
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(outputs, "_new_file", refuse)  # the writers create every file with it
    one_line(*run_cli("plan", "--budget", "4GiB", "--out", tmp_path / "p.yaml"), 2,
             f"--out {tmp_path / 'p.yaml'}: cannot create files in {tmp_path} ({reason})")
    one_line(*run_cli("init", "tiny-qwen3-moe", tmp_path / "ck"), 2,
             f"init: {tmp_path / 'ck'}: cannot create files in {tmp_path} ({reason})")
    assert _listing(tmp_path) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="Linux /proc")
@pytest.mark.parametrize("target", ["/proc/moegraph-plan.yaml", "/sys/moegraph-plan.yaml"])
def test_an_output_under_proc_or_sys(target):
    one_line(*run_cli("plan", "--budget", "4GiB", "--out", target), 2,
             f"--out {target}: cannot create files in {Path(target).parent}")
    assert not Path(target).exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="Linux /proc")
def test_init_under_proc():
    one_line(*run_cli("init", "tiny-qwen3-moe", "/proc/moegraph-ck", "--mkdir"), 2,
             "init: /proc/moegraph-ck: cannot create files in /proc")


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "No space left on device"),
                                          (errno.EIO, "Input/output error")])
def test_a_write_that_fails_names_the_file_exit_1(tmp_path, monkeypatch, code, reason):
    def fail(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(outputs.os, "fsync", fail)
    target = tmp_path / "plan.yaml"
    one_line(*run_cli("plan", "--budget", "4GiB", "--out", target), 1, f"{target}: {reason}")
    assert _listing(tmp_path) == []  # neither the plan nor its temporary file


def test_an_os_error_no_check_caught_names_its_path(tmp_path, monkeypatch):
    """The command wrapper's last line of defence: any OSError with a path, usage or not."""
    import moegraph_cli.report.summary as summary

    def boom(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(summary, "summarize", boom)
    one_line(*run_cli("inspect"), 2, f"{tmp_path / 'x'}: Permission denied")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "y"))

    monkeypatch.setattr(summary, "summarize", full)
    one_line(*run_cli("inspect"), 1, f"{tmp_path / 'y'}: No space left on device")


def test_debug_shows_the_traceback(tmp_path):
    code, _, err = run_process("inspect", tmp_path / LONG, env={"MOEGRAPH_DEBUG": "1"})
    assert code == 1 and "Traceback" in err and "File name too long" in err


# -- stdout: closed, full, a reader that left -------------------------------------------------
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["inspect", "--json"], ["inspect"],
                                  ["plan", "--budget", "4GiB"]])
def test_stdout_full(args):
    with open("/dev/full", "w") as full:
        code, _, err = run_process(*args, stdout=full)
    one_line(code, "", err, 1, "cannot write the output to stdout: No space left on device")


def test_stdout_full_leaves_the_output_file_it_wrote_whole(tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    with open("/dev/full", "w") as full:
        code, _, err = run_process("plan", "--budget", "4GiB", "--out", tmp_path / "p.yaml",
                                   stdout=full)
    one_line(code, "", err, 1, "stdout")
    assert _listing(tmp_path) == ["p.yaml"] and "moegraph_plan: 1" in \
        (tmp_path / "p.yaml").read_text()


@pytest.mark.parametrize("args", [["inspect", "--json"], ["init", "tiny-qwen3-moe", "ck"]])
def test_stdout_closed_is_refused_before_any_work(tmp_path, args):
    args = [str(tmp_path / a) if a == "ck" else a for a in args]
    code, _, err = run_process(*args, shell_redirect=">&-")
    one_line(code, "", err, 1, "stdout is closed")
    assert _listing(tmp_path) == []


def test_stdout_a_pipe_whose_reader_left():
    proc = subprocess.Popen([sys.executable, "-m", "moegraph_cli.app", "inspect", "-p",
                             "qwen3-30b-a3b"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, text=True)
    proc.stdout.close()  # long before the command prints: its first write finds no reader
    err = proc.stderr.read()
    code = proc.wait(timeout=180)
    one_line(code, "", err, 1, "cannot write the output to stdout: the pipe was closed by "
             "its reader")
    assert "Exception ignored" not in err
