"""Run the CLI in-process and get (exit code, stdout, stderr) on any click version; the tiny
model the CLI tests write checkpoints of."""

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


# A tiny-qwen3-moe small enough that `init` and a CPU step take a moment.
TINY = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
        "model.intermediate_size=48", "run.dtype=float32"]
TINY_SET = [a for kv in TINY for a in ("--set", kv)]


def tiny_checkpoint(d, *extra: str):
    """`moegraph init` of the TINY model into `d` (extra: more CLI arguments); returns `d`."""
    code, _, err = run_cli("init", "tiny-qwen3-moe", d, *TINY_SET, *extra)
    assert code == 0, err
    return d
