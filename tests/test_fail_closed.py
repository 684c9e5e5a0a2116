"""Configurations graph capture does not support are refused before anything is captured."""

import pytest

from cli_util import run_cli
from moegraph_cli.plan.capability import check_capturable
from moegraph_cli.config import load_profile
from moegraph_cli.errors import NotCapturableError

CASES = [("run.fp8=true", "fp8"),
         ("run.pipeline_interleave=2", "pipeline_interleave=2"),
         ("run.dynamic_shapes=true", "dynamic_shapes=true with a shared pool")]


@pytest.mark.parametrize("override,needle", CASES)
def test_check_capturable_refuses(override, needle):
    with pytest.raises(NotCapturableError, match=needle):
        check_capturable(load_profile("tiny-qwen3-moe", [override]))


def test_dynamic_shapes_allowed_with_private_pools():
    check_capturable(load_profile("tiny-qwen3-moe", ["run.dynamic_shapes=true"]), "per_entry")


@pytest.mark.parametrize("override,needle", CASES)
def test_plan_fails_closed_with_exit_4(override, needle):
    code, out, err = run_cli("plan", "--budget", "4GiB", "--pool", "shared", "--set", override)
    assert code == 4, (out, err)
    assert err.startswith("moegraph: error: ") and needle in err
    assert len(err.strip().splitlines()) == 1


def test_plan_auto_pool_with_dynamic_shapes_uses_private_pools():
    import json
    code, out, err = run_cli("plan", "--budget", "4GiB", "--set", "run.dynamic_shapes=true",
                             "--json")
    assert code == 0, err
    r = json.loads(out)
    assert {layer["pool"] for layer in r["layers"] if layer["scopes"]} == {"per_entry"}
