"""benchmarks/tiles_ab.py's parsing of --alt on the CPU: a SPEC changes only what it names
(a tile keeps the default's variant, a variant keeps its tile), entries() lists the default,
its twin, each alt and `all`, and bad input is a one-line error before any GPU work."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def ab(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import tiles_ab
    return tiles_ab


def gpu_like_defaults():
    from moegraph_kernels.gemm_config import GemmConfig as G
    from moegraph_cli.moe.experts import TileConfigs
    return TileConfigs(128, G(128, 128, 64, 4, 8, 4, tma=True, persistent=True, paired=True),
                       G(128, 256, 64, 8, 8, 4, tma=True, persistent=True),
                       G(128, 128, 64, 8, 8, 4), G(128, 256, 64, 8, 8, 4, tma=True),
                       G(128, 256, 64, 4, 8, 3, tma=True, persistent=True, store_tma=True),
                       G(256, 128, 64, 4, 8, 3, tma=True, persistent=True))


def test_spec_changes_only_what_it_names(ab):
    d = gpu_like_defaults()
    five = ab.parse_spec("128x128x64x8x8x5", d.dact)
    assert five == d.dact._replace(num_stages=5)
    dxp = ab.parse_spec("+tma+persistent", d.dx)
    assert dxp[:6] == d.dx[:6] and dxp.tma and dxp.persistent
    plain = ab.parse_spec("256x128x64x4x8x3+tma", d.wgrad_gate_up)
    assert plain.tma and not plain.persistent and not plain.store_tma
    assert ab.parse_spec("+base", d.fc1).variant == "base"
    # +keep: the default's own variant parts, whatever they are, plus those named
    assert ab.parse_spec("+keep+store", d.wgrad_gate_up) == \
        d.wgrad_gate_up._replace(store_tma=True)
    assert ab.parse_spec("+keep+noflat", d.fc2) == d.fc2._replace(flatten=False)
    assert ab.parse_spec("+keep+tma", d.dact) == d.dact._replace(tma=True)


def test_entries_default_twin_alts_all(ab):
    d = gpu_like_defaults()
    alts = [ab.parse_alt("dact5:dact=128x128x64x8x8x5"),
            ab.parse_alt("dxp:dx=+tma+persistent,wgrad_gate_up=+tma")]
    e = ab.entries(d, alts)
    assert list(e) == ["default", "twin", "dact5", "dxp", "all"]
    assert e["twin"] == d and e["dact5"] == d._replace(dact=d.dact._replace(num_stages=5))
    assert e["dxp"].dact == d.dact and e["dxp"].dx.persistent
    assert not e["dxp"].wgrad_gate_up.persistent
    assert e["all"].dact.num_stages == 5 and e["all"].dx.persistent
    assert list(ab.entries(d, alts[:1])) == ["default", "twin", "dact5"]


@pytest.mark.parametrize("text", ["nocolon", "x:", "x:dq=+tma", "x:dact", "x:dact="])
def test_bad_alt_is_a_value_error(ab, text):
    with pytest.raises(ValueError, match="--alt"):
        ab.parse_alt(text)


@pytest.mark.parametrize("spec", ["128x128", "128x128x64x8x8xq", "+tmaa"])
def test_bad_spec_is_a_value_error(ab, spec):
    with pytest.raises(ValueError):
        ab.parse_spec(spec, gpu_like_defaults().dact)


@pytest.mark.parametrize("argv,want", [
    (["--alt", "x:nope=+tma"], "KERNEL=SPEC"),
    (["--alt", "twin:dx=+tma"], "must be distinct"),
    (["--routing", "zipf"], "unknown routing"),
    (["--tokens", "8k"], "invalid literal"),
])
def test_cli_bad_input_one_line(argv, want):
    p = subprocess.run([sys.executable, str(BENCH / "tiles_ab.py"), *argv],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and want in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()[-1]) < 300
