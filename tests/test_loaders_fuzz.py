"""Property tests (issue 12): random bytes, random YAML/JSON documents and mutations of valid
ones fed to every loader, and random `--set` strings fed to the CLI. A loader may refuse its
input only with a one-line MoegraphError; the CLI only with exit 1 or 2, one line, no
`internal error` and no traceback."""

import copy
import functools
import itertools
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cli_util import run_cli
from moegraph_cli.config import SECTIONS, ModelConfig, load_profile, read_hf_config
from moegraph_cli.errors import MoegraphError
from moegraph_cli.plan.calibration import load_calibration
from moegraph_cli.plan.runkey import run_key
from moegraph_cli.plan.planfile import load_plan
from moegraph_cli.plan.planner import load_savings, plan_command
from moegraph_cli.train.runspec import resolve
from moegraph_cli.train.trainer import check_token_file

# MOEGRAPH_FUZZ_EXAMPLES=5000 searches harder; the default keeps the file under ~20 s.
FUZZ = settings(max_examples=int(os.environ.get("MOEGRAPH_FUZZ_EXAMPLES", 60)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_names = itertools.count()
_dir = Path(tempfile.mkdtemp(prefix="moegraph-fuzz-"))


def fresh(name: str) -> Path:
    """A new file path per example (the token cache keys on the file's identity)."""
    d = _dir / str(next(_names))
    d.mkdir()
    return d / name


def refuses_cleanly(load) -> None:
    """`load()` succeeds, or fails with a one-line MoegraphError; anything else propagates."""
    try:
        load()
    except MoegraphError as e:
        assert "\n" not in str(e) and str(e).strip(), repr(str(e))


# -- documents ------------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers() | st.floats()
           | st.sampled_from([2**31, 10**400, -(10**400)])
           | st.text(max_size=12) | st.sampled_from(["attn", "moe", "shared", "bfloat16"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=10) | st.integers(), inner, max_size=4),
                      max_leaves=16)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated(draw, base):
    """`base` with one to three random subtrees replaced by random values or removed."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))[1:]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            if draw(st.booleans()) and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = draw(values)
        except (KeyError, IndexError, TypeError):  # an earlier mutation moved the path
            pass
    return doc


@st.composite
def document_bytes(draw, base):
    """Bytes of a file: random, random text, or a (mutated) document as YAML or JSON."""
    kind = draw(st.sampled_from(["bytes", "text", "yaml", "json", "yaml", "json"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "text":
        return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    doc = draw(st.one_of(mutated(base), mutated(base), mutated(base), values))
    if kind == "yaml":
        return yaml.safe_dump(doc, sort_keys=False).encode()
    return json.dumps(doc).encode()


# -- valid documents to start from ----------------------------------------------------------
def _profile_doc() -> dict:
    prof = load_profile("tiny-qwen3-moe")
    doc = prof.to_dict()
    doc["run"]["scopes"] = list(doc["run"]["scopes"])
    return doc


@functools.cache
def _plan_doc() -> dict:
    path = _dir / "plan.yaml"
    plan_command(resolve(), budget="1.5GiB", out=str(path))
    return yaml.safe_load(path.read_text())


def _key() -> dict:
    return run_key(load_profile("tiny-qwen3-moe"))


def _savings_doc() -> dict:
    return {"moegraph_savings": 1, "key": _key(),
            "scopes": {"layers.0.attn": {"kind": "attn", "saved_ms": 0.4},
                       "layers.0.moe": {"kind": "moe", "saved_ms": 0.3}},
            "per_kind": {"attn": {"saved_ms": 0.4}, "moe": {"saved_ms": 0.3}}}


def _calibration_doc() -> dict:
    scope = {"saved_bytes": 100, "out_bytes": 10, "in_grad_bytes": 10, "saves_input": True,
             "fwd_peak_bytes": 200, "bwd_peak_bytes": 300, "private_pools": [50, 60]}
    return {"moegraph_calibration": 1, "entries": [
        {"key": _key(), "scopes": {"attn": dict(scope), "moe": dict(scope)},
         "layer_model": {"pools": {"shared": 1000, "per_scope": 1100},
                         "eager_peak_reserved": 5000}}]}


# -- the loaders ----------------------------------------------------------------------------
@FUZZ
@given(st.data())
def test_profile_loader(data):
    path = fresh("p.yaml")
    path.write_bytes(data.draw(document_bytes(_profile_doc())))
    refuses_cleanly(lambda: load_profile(str(path)))


@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe",
                                     "tiny-qwen2-moe"])
@FUZZ
@given(data=st.data())
def test_config_json_loader(profile, data):
    """Each family's config.json (its own spelling), mutated."""
    path = fresh("config.json")
    path.write_bytes(data.draw(document_bytes(load_profile(profile).model.to_hf_dict())))
    refuses_cleanly(lambda: read_hf_config(path.parent))


@FUZZ
@given(st.data())
def test_plan_loader(data):
    path = fresh("plan.yaml")
    path.write_bytes(data.draw(document_bytes(_plan_doc())))
    prof = load_profile("tiny-qwen3-moe")
    refuses_cleanly(lambda: load_plan(path, prof))


@FUZZ
@given(st.data())
def test_savings_loader(data):
    path = fresh("savings.yaml")
    path.write_bytes(data.draw(document_bytes(_savings_doc())))
    refuses_cleanly(lambda: load_savings(path, _key()))


@FUZZ
@given(st.data())
def test_calibration_loader(data):
    path = fresh("cal.yaml")
    path.write_bytes(data.draw(document_bytes(_calibration_doc())))
    refuses_cleanly(lambda: load_calibration(path))


DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
          torch.float32, torch.bfloat16, torch.complex64]
saved_objects = st.one_of(
    st.builds(lambda dtype, n, low, span: (torch.randint(low, low + span, (n,)).to(dtype)),
              st.sampled_from(DTYPES), st.integers(0, 40), st.integers(-50, 150),
              st.integers(1, 100)),
    st.builds(lambda n: torch.arange(n).reshape(-1, 2) if n % 2 == 0 else torch.arange(n),
              st.integers(0, 20)),
    values.filter(lambda v: v is not None),  # dicts, lists, numbers: not a tensor
)


@FUZZ
@given(suffix=st.sampled_from([".pt", ".bin", ".pt", ".npy"]),
       raw=st.none() | st.binary(max_size=120), obj=saved_objects)
def test_token_file_loader(suffix, raw, obj):
    path = fresh("tokens" + suffix)
    if raw is not None:
        path.write_bytes(raw)
    else:
        torch.save(obj, path)
    refuses_cleanly(lambda: check_token_file(path, vocab_size=100, need=4))


# -- --set on the command line ------------------------------------------------------------
FIELDS = sorted({name for cls in SECTIONS.values() for name in cls.__dataclass_fields__})
VALUE_TEXTS = ["", "null", "~", "true", "[1", "{a: 1}", ".nan", "-.inf", "1e-5", "0x10",
               "2001-02-30", "!!binary x", "!!python/object:os.system", "[0, 1]", "attn,moe",
               "cpu", "cuda:0", "'quoted'", "&a [*a]", "*undefined", "- x", "a: b", "\t", "%",
               "[[[[[[[[", "1" * 5000, "2147483647", "2147483648", "1" + "0" * 400,
               "-1" + "0" * 400, "1e400", "[1" + "0" * 400 + "]"]
set_values = (st.sampled_from(VALUE_TEXTS) | st.integers(-10, 64).map(str)
              | st.floats().map(str) | st.text(max_size=12))
set_items = st.one_of(
    st.text(max_size=30),
    st.builds(lambda sec, field, value: f"{sec}{field}={value}",
              st.sampled_from(["model.", "run.", "moe.", "model", "run", "moe", "", "x.", ".",
                               " run."]),
              st.sampled_from(FIELDS) | st.text(max_size=6), set_values))


def _huge_count(item: str) -> bool:
    """A layer or expert count of many thousands: valid input that `inspect` summarises
    layer by layer, too slowly for this test; not what it is about."""
    key, _, text = item.partition("=")
    if key.strip().rpartition(".")[2] not in ("num_hidden_layers", "num_experts"):
        return False
    try:
        value = yaml.safe_load(text)
    except Exception:  # noqa: BLE001 - the CLI's own parse is what is under test
        return False
    return isinstance(value, int) and value > 512


@FUZZ
@given(items=st.lists(set_items, min_size=1, max_size=3))
def test_set_strings_on_the_cli(items):
    assume(not any(_huge_count(item) for item in items))
    args = [a for item in items for a in ("--set", item)]
    code, out, err = run_cli("inspect", *args)
    assert code in (0, 1, 2), (code, err)
    assert "internal error" not in err and "Traceback" not in out + err, err
    if code:
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("moegraph: error: "), err


@pytest.mark.parametrize("item", ["model=3", "run.seq_len=[1", "run.lr=.nan", "model.=1"])
def test_set_examples_stay_usage_errors(item):
    code, _, err = run_cli("inspect", "--set", item)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
