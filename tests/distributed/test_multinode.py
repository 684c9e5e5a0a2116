"""Two nodes on one machine: two `torchrun --nnodes 2` launches (node ranks 0 and 1, 2 ranks
each) meet at a loopback master and train one job over gloo. The experts' replicas (ep 2 on
4 ranks: ranks 0 and 2, 1 and 3) sit on different nodes, so their FSDP2 all-gathers and
reduce-scatters cross the node boundary; EP stays inside a node."""

import json
import os
import subprocess
import sys
from pathlib import Path

from gloo_util import free_port

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "run.device=cpu", "run.dtype=float32", "run.seq_len=16"]
_LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "MOEGRAPH_LAUNCHED", "MOEGRAPH_ERROR_DIR")


def test_two_torchrun_nodes_train_one_job():
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    port = free_port()
    args = ["verify", "--ep", "2", "--reference", "single", "--no-lr0", "--steps", "2",
            "--tolerance", "1e-5", "--json", *[a for o in SMALL for a in ("--set", o)]]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--node-rank", str(r), "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "moegraph_cli.app", *args],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for r in (0, 1)]
    try:
        outs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-2000:]
    assert outs[1][0] == ""  # rank 0 (node 0) alone renders
    doc = json.loads(outs[0][0])
    assert doc["world_size"] == 4 and doc["ep"] == 2 and doc["passed"], doc["verdict"]
    assert [row["rank"] for row in doc["ranks"]] == [0, 1, 2, 3]
    # every rank, on either node, tracked its graphs bitwise; the job equals one process
    assert all(row["passed"] and row["bitwise_equal"] for row in doc["ranks"])
    ref = doc["reference"]
    assert ref["kind"] == "single" and ref["max_rel"] <= 1e-5
    assert len({tuple(row["eager_losses"]) for row in doc["ranks"]}) == 4  # own data each
