"""A rank of `moegraph verify --nproc 2` (CPU, gloo) that dies or stops mid-run: the one line
names the rank and how it ended (killed by a signal), or, for a stopped rank, the phase the
survivor was stuck in; not the survivor's symptom ("Connection closed by peer").

The launcher's stderr is a terminal (a pty), so rank 0 draws its progress bar there: the test
acts once the bar says the steps have begun, i.e. mid-run, past set-up and capture."""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# MOEGRAPH_COLLECTIVE_TIMEOUT_S, the watchdog's deadline: far above the killed rank's
# expected end (the survivor must not wait for it), and for the stopped rank a few times the
# longest gap between heartbeats at these sizes (a set-up stage, a step), which it waits out.
# Under CI load (two test workers on two cores beside the two ranks) a set-up stage has taken
# over 8 s, so the stopped rank's deadline is the same 20 s.
TIMEOUT_S = 20
STOPPED_TIMEOUT_S = 20
# verify's bar reads "steps" once capture is done (after "verify"); rich redraws the line
# with a carriage return and an erase-line code before it.
STEPS_BEGUN = re.compile(r"(\r|\x1b\[2K)steps ")
# CPU-small widths: a step takes milliseconds, so 2000 of them outlast the test's actions
SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "run.device=cpu", "run.dtype=float32",
         "run.seq_len=32"]
ARGS = ["verify", "--nproc", "2", "--steps", "2000", *[a for o in SMALL for a in ("--set", o)]]


def _env(timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MOEGRAPH_ERROR_DIR",
                        "MOEGRAPH_DEBUG")}
    env.update(TERM="xterm", COLUMNS="100", MOEGRAPH_COLLECTIVE_TIMEOUT_S=str(timeout_s))
    return env


def _ranks(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's child processes (from their RANK variable)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            for item in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(entry)
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run(act, after_act=None, timeout_s: float = TIMEOUT_S, limit_s: float = 400):
    """Run ARGS with stderr on a pty; `act(ranks)` once the steps have begun, then
    `after_act(ranks)` on every poll until the launcher exits. (code, terminal text,
    seconds from act to exit)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "moegraph_cli.app", *ARGS], cwd=REPO,
                            env=_env(timeout_s), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=slave)
    os.close(slave)
    text, acted_at, ranks = "", None, {}
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # every writer closed the pty: the job is over
                    break
                if not chunk:
                    break
                text += chunk.decode("utf-8", "replace")
            if acted_at is None and STEPS_BEGUN.search(text):
                time.sleep(1.0)  # a step or so into the loop
                ranks = _ranks(proc.pid)
                assert sorted(ranks) == [0, 1], ranks
                act(ranks)
                acted_at = time.monotonic()
            elif acted_at is not None and after_act is not None:
                after_act(ranks)
            if proc.poll() is not None and not ready:
                break
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # the test failed: nothing of this job may outlive it
            for pid in _ranks(proc.pid).values():
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
        for pid in ranks.values():
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        os.close(master)
    assert acted_at is not None, text[-2000:]
    return code, text, time.monotonic() - acted_at


def _the_line(text: str) -> str:
    lines = re.findall(r"moegraph: (?:error|warning): [^\r\n]*", text)
    assert len(lines) == 1, lines
    assert "Traceback" not in text and "internal error" not in text, text[-2000:]
    return lines[0]


def test_a_killed_rank_is_named_with_its_signal():
    code, text, after = _run(lambda ranks: os.kill(ranks[1], signal.SIGKILL))
    assert code == 1
    assert _the_line(text) == (
        "moegraph: error: rank 1 was killed by signal 9 (SIGKILL; the kernel's OOM killer "
        "sends it too); the other ranks were stopped")
    assert after < 15, after  # the survivor does not wait for a timeout


def test_a_stopped_rank_is_ended_by_the_watchdog_naming_the_phase():
    def resume_once_rank0_is_gone(ranks):
        if not _alive(ranks[0]) and _alive(ranks[1]):
            os.kill(ranks[1], signal.SIGCONT)  # its pending SIGTERM from the launcher ends it

    code, text, after = _run(lambda ranks: os.kill(ranks[1], signal.SIGSTOP),
                             resume_once_rank0_is_gone, timeout_s=STOPPED_TIMEOUT_S)
    assert code == 1
    line = _the_line(text)
    assert line.startswith(f"moegraph: error: rank 0: no progress for {STOPPED_TIMEOUT_S} s "
                           "during steps ("), line
    assert line.endswith("done): a collective did not complete (another rank failed or hung)")
    assert "start-up" not in line and "set-up" not in line
    assert after < STOPPED_TIMEOUT_S + 30, after


@pytest.fixture(autouse=True)
def _linux_only():
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads /proc to find the ranks")
