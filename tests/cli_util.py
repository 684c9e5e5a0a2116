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
