"""train/allocator.eager_segments: expandable segments for an eager phase, unless the user
chose the allocator's mode; the default mode again afterwards, even when the phase fails."""

import warnings

import pytest
import torch

from moegraph_cli.train import allocator


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: seen.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty_cache"))
    monkeypatch.setattr(allocator, "_set", lambda on: seen.append(on))
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", allocator.ENV):
        monkeypatch.delenv(name, raising=False)
    return seen


def test_switched_on_for_the_block_and_back_off_after_it(calls):
    with allocator.eager_segments() as on:
        assert on and calls == [True]
    assert calls == [True, "sync", "empty_cache", False]


def test_back_off_when_the_phase_raises(calls):
    with pytest.raises(RuntimeError):
        with allocator.eager_segments():
            raise RuntimeError("out of memory")
    assert calls[-1] is False


@pytest.mark.parametrize("name,value", [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),
                                        ("PYTORCH_ALLOC_CONF", "expandable_segments:True"),
                                        (allocator.ENV, "0")])
def test_left_alone_where_the_user_chose(calls, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with allocator.eager_segments() as on:
        assert not on
    assert calls == []


def test_nothing_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with allocator.eager_segments() as on:
        assert not on


def test_setting_the_mode_warns_nothing():
    """torch 2.11+ deprecates torch.cuda.memory._set_allocator_settings with a FutureWarning,
    which `capture` printed on every run; the setter it forwards to is called instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        allocator._set(False)  # the default mode: a no-op on a machine without CUDA
