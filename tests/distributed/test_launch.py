"""The multi-process launcher: what the user sees when 2 gloo ranks succeed, fail, hang, crash.

Each launch runs in a fresh interpreter so the test captures exactly what the launching
process prints; the ranks run tests/distributed/launch_target.py (on CPU, gloo backend).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moegraph_cli.distributed.launch as launch_mod
from moegraph_cli.distributed.launch import (WorkerEnv, argv_without_nproc, is_rank0,
                                             launched_by_moegraph, maybe_launch, report_error,
                                             worker_env)
from moegraph_cli.errors import UsageError

pytest.importorskip("torch.distributed.run")

REPO = Path(__file__).resolve().parents[2]
TARGET_DIR = Path(__file__).resolve().parent
_LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MOEGRAPH_LAUNCHED",
                 "MOEGRAPH_ERROR_DIR", "MOEGRAPH_COLLECTIVE_TIMEOUT_S", "MOEGRAPH_DEBUG")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TARGET_DIR), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _launch_cmd(mode_argv: list[str], timeout_s: float = 60) -> list[str]:
    code = ("from moegraph_cli.distributed.launch import launch; import sys; "
            f"sys.exit(launch({mode_argv!r}, 2, module='launch_target', timeout_s={timeout_s}))")
    return [sys.executable, "-c", code]


def _launch(*mode_argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(_launch_cmd(list(mode_argv)), capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=_env())


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("moegraph: error:")]


# ------------------------------------------------------------------------- with processes


def test_ok_returns_0_and_only_rank0_output_reaches_the_terminal():
    result = _launch("ok")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines().count("sum=3") == 1  # both ranks print it
    assert "rank 0 stderr noise" in result.stderr
    assert "rank 1 stderr noise" not in result.stderr
    # the launcher itself is silent: no elastic log lines, no OMP_NUM_THREADS banner
    assert result.stderr.strip() == "rank 0 stderr noise"


def test_fail_prints_the_failing_ranks_line_once_and_returns_its_code():
    result = _launch("fail")
    assert result.returncode == 2, result.stderr
    assert _error_lines(result.stderr) == [
        "moegraph: error: rank 1: bad --ep 3: 8 experts do not split over 3 ranks"]
    assert result.stderr.strip().count("\n") == 0  # nothing but that one line


def test_hang_is_ended_by_rank0s_watchdog():
    start = time.monotonic()
    result = _launch("hang")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert elapsed < 60
    assert _error_lines(result.stderr) == [
        "moegraph: error: rank 0: no progress for 3 s during all_reduce: a collective did "
        "not complete (another rank failed or hung)"]


def test_crash_without_report_names_rank_code_and_last_stderr_line():
    result = _launch("crash")
    assert result.returncode == 1, result.stderr
    assert _error_lines(result.stderr) == [
        "moegraph: error: rank 1 exited with code 1; its last stderr line: "
        "RuntimeError: boom in rank 1"]
    assert "Traceback" not in result.stderr  # rank 1's traceback stays in its log file


def test_ctrl_c_stops_every_rank_and_returns_130(tmp_path):
    proc = subprocess.Popen(_launch_cmd(["sleep", str(tmp_path)]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    assert alive == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie answers kill(0) but is gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------- without processes


@pytest.mark.parametrize("argv, expected", [
    (["capture", "--nproc", "4", "--json"], ["capture", "--json"]),
    (["capture", "--nproc=4", "--set", "run.steps=2"], ["capture", "--set", "run.steps=2"]),
    (["--nproc", "2"], []),
    (["verify", "--nprocs=2"], ["verify", "--nprocs=2"]),  # not our option: left alone
    (["plan", "--", "--nproc", "2"], ["plan", "--", "--nproc", "2"]),
])
def test_argv_without_nproc(argv, expected):
    assert argv_without_nproc(argv) == expected


def _clear_launcher_env(monkeypatch):
    for key in _LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)


def _as_rank(monkeypatch, rank: int, world_size: int = 4):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))


def test_worker_env_reads_torchrun_variables(monkeypatch):
    _clear_launcher_env(monkeypatch)
    assert worker_env() is None
    assert is_rank0() and not launched_by_moegraph()
    _as_rank(monkeypatch, 3)
    assert worker_env() == WorkerEnv(rank=3, world_size=4, local_rank=3, local_world_size=4)
    assert not is_rank0() and not launched_by_moegraph()
    monkeypatch.setenv("MOEGRAPH_LAUNCHED", "1")
    assert launched_by_moegraph()


def test_report_error_writes_one_atomic_file_and_keeps_the_first(monkeypatch, tmp_path, capsys):
    _clear_launcher_env(monkeypatch)
    _as_rank(monkeypatch, 3)
    monkeypatch.setenv("MOEGRAPH_ERROR_DIR", str(tmp_path))
    before = time.time()
    report_error("bad --ep 3:\n  8 experts", 2)
    report_error("a later consequence", 1)
    assert [p.name for p in tmp_path.iterdir()] == ["rank3.json"]  # no temp file left
    record = json.loads((tmp_path / "rank3.json").read_text())
    assert record["rank"] == 3 and record["exit_code"] == 2
    assert record["message"] == "bad --ep 3: 8 experts"
    assert before <= record["time"] <= time.time()
    assert capsys.readouterr().err == ""


def test_report_error_under_bare_torchrun_prints_one_line(monkeypatch, capsys):
    _clear_launcher_env(monkeypatch)
    _as_rank(monkeypatch, 1)
    report_error("bad --ep 3: 8 experts", 2)
    assert capsys.readouterr().err == "moegraph: error: rank 1: bad --ep 3: 8 experts\n"


def test_maybe_launch_stays_in_process_or_validates(monkeypatch):
    _clear_launcher_env(monkeypatch)
    calls = []
    monkeypatch.setattr(launch_mod, "launch",
                        lambda argv, nproc, **kw: calls.append((argv, nproc, kw)) or 7)
    assert maybe_launch(["capture"], None) is None
    assert maybe_launch(["capture", "--nproc", "1"], 1) is None
    with pytest.raises(UsageError, match="--nproc must be at least 1, got 0"):
        maybe_launch(["capture", "--nproc", "0"], 0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    with pytest.raises(UsageError, match="--nproc 4: this machine has 2 CUDA devices"):
        maybe_launch(["capture", "--nproc", "4"], 4)
    monkeypatch.setenv("MOEGRAPH_COLLECTIVE_TIMEOUT_S", "90")
    assert maybe_launch(["capture", "--nproc=2", "--json"], 2) == 7
    assert calls == [(["capture", "--json"], 2, {"timeout_s": 90.0})]
    _as_rank(monkeypatch, 0, world_size=2)  # inside a rank: never launch again
    assert maybe_launch(["capture", "--nproc", "2"], 2) is None
    assert len(calls) == 1


# ------------------------------------------------------------------------------ watchdog


def _watchdog_run(body: str) -> subprocess.CompletedProcess:
    code = "import time\nfrom moegraph_cli.distributed.watchdog import Watchdog\n" + body
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=_env())


def test_watchdog_ends_a_stuck_process_naming_the_phase():
    result = _watchdog_run("with Watchdog(0.5, 0) as wd:\n"
                           "    wd.phase('step 2 replay')\n"
                           "    time.sleep(30)\n")
    assert result.returncode == 1
    assert result.stderr == ("moegraph: error: rank 0: no progress for 0.5 s during step 2 "
                             "replay: a collective did not complete (another rank failed or "
                             "hung)\n")


def test_watchdog_is_kept_alive_by_beats_and_stops_with_its_context():
    result = _watchdog_run("with Watchdog(0.5, 0) as wd:\n"
                           "    for _ in range(15):\n"
                           "        time.sleep(0.1)\n"
                           "        wd.beat()\n"
                           "time.sleep(1.5)\n"
                           "print('done')\n")
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")
