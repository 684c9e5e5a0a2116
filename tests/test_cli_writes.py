"""What a command that writes leaves behind: SIGTERM, SIGHUP and Ctrl-C during `init` (real
signals to a real `moegraph` process) or during any other write, a command interrupted after
writing some of its outputs, the hidden temporary files of a process killed outright, and what
`init --force` reports. Each case asserts the exit code, that stderr is one line, and what is
left on disk."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_util import TINY_SET, one_line, run_cli
from moegraph_cli.commands.cli_signals import signals_interrupt
from moegraph_cli.errors import Interrupted, UsageError
from moegraph_cli.io import outputs
from moegraph_cli.io.outputs import removed_on_interrupt, write_text_atomically
from moegraph_cli.units import fmt_bytes

REPO = Path(__file__).resolve().parents[1]
_ENTRY = Path(sys.executable).with_name("moegraph")
MOEGRAPH = [str(_ENTRY)] if _ENTRY.is_file() else [sys.executable, "-m", "moegraph_cli.app"]
# The default tiny-qwen3-moe is 80 MB of bf16: at 30 MB a shard, the embedding, the layers and
# the head go to three files, written over a few seconds.
FIRST_SHARD = re.compile(r"model-00001-of-\d{5}\.safetensors")
SECOND_TEMPORARY = re.compile(r"\.model-00002-of-\d{5}\.safetensors\.\w{8}\.tmp")


def _listing(path: Path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _signals_at_default():
    """In the child: the three signals at their default, as in a terminal, even where this
    test runs in the background (SIGINT ignored) or under nohup (SIGHUP ignored)."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


def _wait_for(proc, directory: Path, *patterns, timeout=120.0) -> None:
    """Until `directory` holds a file matching each pattern (the process still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        names = os.listdir(directory) if directory.is_dir() else []
        if all(any(p.fullmatch(n) for n in names) for p in patterns):
            return
        time.sleep(0.01)
    raise AssertionError(f"{patterns} never appeared in {directory}")


# -- real signals to a real `moegraph init` ---------------------------------------------------
@pytest.mark.parametrize("signum, made", [(signal.SIGTERM, True), (signal.SIGHUP, False),
                                          (signal.SIGINT, True)],
                         ids=["SIGTERM-new-dir", "SIGHUP-existing-dir", "SIGINT-new-dir"])
def test_a_signal_during_init_leaves_nothing_and_a_second_init_works(tmp_path, signum, made):
    """Signalled while it writes its second shard (the first one done): the finished shard,
    the hidden temporary file and the directories the run made are all gone, and `init`
    into the same directory then works."""
    target = tmp_path / "new" / "ck" if made else tmp_path / "ck"
    if not made:
        target.mkdir()
    before = _listing(tmp_path)
    proc = subprocess.Popen([*MOEGRAPH, "init", "tiny-qwen3-moe", str(target), "--mkdir",
                             "--max-shard-size", "30MB", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=_signals_at_default)
    try:
        _wait_for(proc, target, FIRST_SHARD, SECOND_TEMPORARY)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    name = signal.Signals(signum).name
    one_line(proc.returncode, out, err, 128 + signum, f"interrupted by {name}")
    assert out == ""
    assert _listing(tmp_path) == before  # ck (and new/) removed if this run made them
    code, out, err = run_cli("init", "tiny-qwen3-moe", target, *TINY_SET, "--mkdir", "--json")
    assert code == 0 and err == "", err
    assert json.loads(out)["files"] == sorted(os.listdir(target)) == \
        ["config.json", "model.safetensors"]


def test_a_signal_during_plan_out_removes_the_file_and_the_directories_it_made(tmp_path,
                                                                            monkeypatch):
    """Any command's write: SIGTERM arrives in the middle of writing the plan (sent by the
    process to itself once the bytes are in the temporary file)."""
    real = outputs.file_mode

    def signalled():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # else it would kill us
        os.kill(os.getpid(), signal.SIGTERM)
        return real()

    monkeypatch.setattr(outputs, "file_mode", signalled)
    before = signal.getsignal(signal.SIGTERM)
    target = tmp_path / "a" / "b" / "plan.yaml"
    one_line(*run_cli("plan", "--budget", "4GiB", "--out", target, "--mkdir"), 143,
             "interrupted by SIGTERM")
    assert _listing(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was put back


# -- how signals become Interrupted -------------------------------------------------------------
def test_signals_interrupt_raises_and_restores():
    # The default action, whatever the runner's was: under nohup SIGHUP starts ignored, and an
    # ignored signal stays ignored (the next test).
    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(Interrupted) as e:
            with signals_interrupt():
                assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL  # else it kills us
                # raise_signal delivers to this (the main) thread, so the handler runs as it
                # returns; os.kill may land on another of the process's threads
                # (pytest-xdist's, torch's), and the main thread would only see it after the
                # block had ended.
                signal.raise_signal(signal.SIGHUP)
                time.sleep(5)
        assert e.value.signum == signal.SIGHUP and e.value.exit_code == 129
        assert isinstance(e.value, KeyboardInterrupt)  # every Ctrl-C cleanup runs for it
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, inherited)


def test_a_signal_the_process_ignores_stays_ignored():
    """nohup's SIGHUP: a command started under nohup goes on when its terminal closes."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals_interrupt():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_launched_rank_keeps_the_default_sigterm(monkeypatch):
    """The launcher stops ranks with SIGTERM and names them by it (distributed/launch.py)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    before = signal.getsignal(signal.SIGTERM)
    with signals_interrupt():
        assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_signal_ends_a_slow_cleanup_at_once():
    code = ("import sys, time\n"
            "from moegraph_cli.commands.cli_signals import signals_interrupt\n"
            "with signals_interrupt():\n"
            "    try:\n"
            "        print('ready', flush=True); time.sleep(60)\n"
            "    finally:\n"
            "        print('cleaning', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, preexec_fn=_signals_at_default)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "cleaning"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- an interrupted command's outputs -------------------------------------------------------------
def test_an_interrupted_command_removes_the_outputs_it_created(tmp_path):
    """profile writes up to three files; an interruption at the last removes the others."""
    (tmp_path / "old.yaml").write_text("old")
    with pytest.raises(Interrupted):
        with removed_on_interrupt():
            write_text_atomically(tmp_path / "new" / "savings.json", "{}")
            write_text_atomically(tmp_path / "old.yaml", "replaced")
            raise Interrupted(signal.SIGTERM)
    # what it created is gone; the file it replaced keeps its new, whole content
    assert _listing(tmp_path) == ["old.yaml"]
    assert (tmp_path / "old.yaml").read_text() == "replaced"


def test_a_command_that_fails_keeps_the_outputs_it_wrote_whole(tmp_path):
    """An error is no interruption: what was written is whole and stays (the plan of a
    `plan --out` whose stdout was full, test_cli_os_errors.py)."""
    with pytest.raises(UsageError):
        with removed_on_interrupt():
            write_text_atomically(tmp_path / "a.json", "{}")
            raise UsageError("a later step failed")
    with removed_on_interrupt():
        write_text_atomically(tmp_path / "b.json", "{}")
    assert _listing(tmp_path) == ["a.json", "b.json"]


# -- leftovers of a process killed outright, and init --force ------------------------------------
def test_init_names_the_hidden_leftovers_of_a_killed_run(tmp_path):
    target = tmp_path / "ck"
    target.mkdir()
    leftover = target / ".model-00001-of-00002.safetensors.k3xq9a0b.tmp"  # mkstemp's name
    leftover.write_bytes(b"\0" * 100)
    one_line(*run_cli("init", "tiny-qwen3-moe", target, *TINY_SET), 2,
             f"init: {target} holds only {leftover.name}, hidden temporary files of writes "
             "that did not finish", "remove them, or use --force")
    assert os.listdir(target) == [leftover.name]
    code, out, err = run_cli("init", "tiny-qwen3-moe", target, *TINY_SET, "--force", "--json")
    assert code == 0, err
    assert json.loads(out)["files"] == sorted(os.listdir(target)) == \
        ["config.json", "model.safetensors"]  # the leftover is gone


def test_init_force_reports_only_what_it_wrote(tmp_path):
    target = tmp_path / "ck"
    target.mkdir()
    (target / "notes.txt").write_text("mine" * 1000)
    (target / "tokenizer.json").write_text("{}")
    code, out, err = run_cli("init", "tiny-qwen3-moe", target, *TINY_SET, "--force",
                             "--max-shard-size", "20KB", "--json")
    assert code == 0, err
    result = json.loads(out)
    ours = sorted(set(os.listdir(target)) - {"notes.txt", "tokenizer.json"})
    assert result["files"] == ours and len(ours) > 3  # shards, index, config.json
    assert result["bytes"] == sum((target / f).stat().st_size for f in ours)
    assert (target / "notes.txt").read_text() == "mine" * 1000

    code, out, err = run_cli("init", "tiny-qwen3-moe", target, *TINY_SET, "--force")
    assert code == 0, err
    ours = ["config.json", "model.safetensors"]  # the earlier shards were replaced
    assert sorted(os.listdir(target)) == sorted(ours + ["notes.txt", "tokenizer.json"])
    size = sum((target / f).stat().st_size for f in ours)
    assert out.strip().endswith(f"to {target}: 2 files, {fmt_bytes(size)}"), out
