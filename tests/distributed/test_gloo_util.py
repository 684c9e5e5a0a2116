"""tests/gloo_util.run_gloo: a process group whose port was taken between free_port and rank
0's listen is made again on a new port; a failure inside the ranks' function is not retried."""

import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import gloo_util


def _world_is(rank, world, want):
    assert dist.get_world_size() == world == want and dist.get_rank() == rank


def _fails(rank, world):
    raise RuntimeError(f"rank {rank} failed on purpose (EADDRINUSE in its message)")


def test_a_taken_port_is_retried_on_a_new_one(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = gloo_util.free_port
        asked = []

        def free_port():
            asked.append(ports.pop() if ports else real())
            return asked[-1]
        monkeypatch.setattr(gloo_util, "free_port", free_port)
        gloo_util.run_gloo(_world_is, 2, 2)
    assert len(asked) == 2 and asked[0] != asked[1]


def test_a_failure_in_the_function_is_raised_at_once(monkeypatch):
    asked = []
    real = gloo_util.free_port
    monkeypatch.setattr(gloo_util, "free_port", lambda: asked.append(1) or real())
    with pytest.raises(mp.ProcessRaisedException, match="failed on purpose"):
        gloo_util.run_gloo(_fails, 2)
    assert len(asked) == 1
