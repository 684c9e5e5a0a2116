"""Markers for tests that need a capability some supported torch lacks."""

import pytest

from moegraph_cli.distributed.layout import per_parameter_mesh

# Sharding experts over their replicas with 1 < ep < world needs FSDP2's per-parameter mesh
# (torch 2.13 has it, 2.11 not); without it the run keeps them whole on every replica, and
# the plan counts them so (distributed/layout.experts_sharded).
needs_mesh = pytest.mark.skipif(not per_parameter_mesh(),
                                reason="this torch's FSDP2 has no per-parameter mesh")
