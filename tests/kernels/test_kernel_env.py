"""The MOEGRAPH_* tile variables: parsed once at import, and a bad one is a usage error of one
line (exit 2) from any command that loads the kernels."""

import pytest
import typer

from moegraph_cli.app import command
from moegraph_kernels.env import KernelEnvError, flag_from_env, ints_from_env


def test_flag_from_env(monkeypatch):
    monkeypatch.delenv("MOEGRAPH_X_FLAG", raising=False)
    assert flag_from_env("MOEGRAPH_X_FLAG", True) and not flag_from_env("MOEGRAPH_X_FLAG", False)
    for value, want in (("1", True), ("0", False), ("", True)):
        monkeypatch.setenv("MOEGRAPH_X_FLAG", value)
        assert flag_from_env("MOEGRAPH_X_FLAG", True) is want
    for bad in ("yes", "2", "true"):
        monkeypatch.setenv("MOEGRAPH_X_FLAG", bad)
        with pytest.raises(KernelEnvError, match=r"^MOEGRAPH_X_FLAG='.*': expected 0 or 1$"):
            flag_from_env("MOEGRAPH_X_FLAG", False)


def test_ints_from_env(monkeypatch):
    monkeypatch.delenv("MOEGRAPH_X_TILE", raising=False)
    assert ints_from_env("MOEGRAPH_X_TILE", "a,b,c") is None
    monkeypatch.setenv("MOEGRAPH_X_TILE", "1,2048,8")
    assert ints_from_env("MOEGRAPH_X_TILE", "a,b,c") == (1, 2048, 8)
    for bad in ("abc", "1,2", "1,2,3,4", "1,0,8", "1,-2,8", "1,,8"):
        monkeypatch.setenv("MOEGRAPH_X_TILE", bad)
        with pytest.raises(KernelEnvError, match=r"^MOEGRAPH_X_TILE='.*': expected 3 positive "
                                                 r"integers a,b,c$"):
            ints_from_env("MOEGRAPH_X_TILE", "a,b,c")


def test_a_bad_tile_variable_is_a_one_line_usage_error(monkeypatch, capsys):
    monkeypatch.delenv("MOEGRAPH_DEBUG", raising=False)
    monkeypatch.setenv("MOEGRAPH_FC1_TILE", "128,128")

    @command
    def load():
        from moegraph_kernels.gemm_config import tile_from_env
        tile_from_env("MOEGRAPH_FC1_TILE")

    with pytest.raises(typer.Exit) as exc:
        load()
    assert exc.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MOEGRAPH_FC1_TILE='128,128': expected 6 positive integers" in err[0]


def test_a_bad_store_flag_is_a_one_line_usage_error(monkeypatch, capsys):
    monkeypatch.delenv("MOEGRAPH_DEBUG", raising=False)
    monkeypatch.setenv("MOEGRAPH_FC1_TMA_STORE", "yes")

    @command
    def load():
        flag_from_env("MOEGRAPH_FC1_TMA_STORE", False)

    with pytest.raises(typer.Exit) as exc:
        load()
    assert exc.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MOEGRAPH_FC1_TMA_STORE='yes': expected 0 or 1" in err[0]
