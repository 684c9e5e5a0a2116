"""Run the CLI in-process and get (exit code, stdout, stderr) on any click version."""

import inspect

from typer.testing import CliRunner

from moegraph_cli.app import app


def run_cli(*args: str):
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        runner = CliRunner(mix_stderr=False)
    else:
        runner = CliRunner()
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def one_line(code, out, err, expected_code, *needles):
    """A CLI failure as the user sees it: the exit code, one `moegraph: error:` line on stderr
    holding every needle, no traceback; returns the line."""
    assert code == expected_code, (code, out, err)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("moegraph: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "internal error" not in err and "Traceback" not in out + err
    return lines[0]
