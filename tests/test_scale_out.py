"""Scaling out: the RL trainer worker across two "nodes" simulated on 127.0.0.1, and the SLURM
template.

Two torchrun agents (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous at 127.0.0.1:PORT, each
agent its own process tree as on two hosts) run ``-m train.rl.worker`` on one shared exchange
directory; the mesh (TSP 2, or DP 2) spans both agents. Three batches are written while they run;
the worker must consume them, publish versions 1..3 and end with the weights of the
single-process reference (train.parallel.rl_update.reference_update) within 1e-5.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_rl_distributed import (ROOT, TOL, _final_weights, _finish, _free_port, _kill_tree, _max_err, rl_cfg,
                                       worker_setup)  # noqa: F401  (worker_setup is a fixture)

SBATCH = ROOT / "scripts" / "slurm" / "cascade_rl.sbatch"


def _start_two_nodes(exchange: Path, model_dir: Path, steps: int, tsp: int, dp: int):
    """Two torchrun agents, one rank each, meeting at one c10d rendezvous endpoint."""
    from train.rl.worker import config_dict, launch_command

    cfg_path = exchange.parent / "rl.json"
    cfg_path.write_text(json.dumps(config_dict(rl_cfg("dppo_tv"))))
    endpoint, rdzv_id = f"127.0.0.1:{_free_port()}", f"scale-out-{time.time_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    agents = []
    for node in range(2):
        cmd = launch_command(exchange, model_dir, 1, steps, cfg_path, tsp=tsp, nnodes=2, rdzv_endpoint=endpoint,
                             rdzv_id=rdzv_id, extra=["--dp", str(dp), "--poll", "0.02", "--max-wait", "120"])
        log = open(exchange.parent / f"node{node}.log", "w")
        agents.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True), log))
    return agents, cmd


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tsp,dp", [(2, 1), (1, 2)], ids=["tsp2", "dp2"])
def test_two_node_worker_equals_reference(worker_setup, tsp, dp):  # noqa: F811
    from train.rl.exchange import complete_versions, load_version, write_batch

    root, batches, (_, ref3) = worker_setup
    ex = root / f"two_nodes_tsp{tsp}_dp{dp}" / "exchange"
    ex.mkdir(parents=True)
    agents, cmd = _start_two_nodes(ex, root / "init", 3, tsp=tsp, dp=dp)
    # the command is the two-node form: c10d rendezvous, one rank per agent
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "1" and "--standalone" not in cmd
    try:
        for b in batches:
            write_batch(ex, b)
        for proc, log in agents:
            _finish(proc, log, timeout=150)  # both agents exit 0
    finally:
        for proc, log in agents:  # a failed agent leaves the other waiting at a collective
            if proc.poll() is None:
                _kill_tree(proc.pid)
                proc.wait()
            log.close()
    assert complete_versions(ex) == [1, 2, 3]
    metrics = [json.loads((ex / "metrics" / f"step-{i:06d}.json").read_text()) for i in range(3)]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert _max_err(load_version(ex, 3)[1], ref3) < TOL
    assert _max_err(_final_weights(ex), ref3) < TOL
    logs = [(ex.parent / f"node{n}.log").read_text() for n in range(2)]
    start = [json.loads(line) for text in logs for line in text.splitlines() if line.startswith('{"worker": "start"')]
    # one world: a dp x tsp = 2 mesh (RLUpdater checks it equals the world size) from agents of one
    # rank each, so the world spans both agents; only global rank 0 prints
    assert len(start) == 1 and (start[0]["tsp"], start[0]["dp"]) == (tsp, dp), logs


def test_launch_command_two_nodes_needs_endpoint():
    from train.rl.worker import launch_command

    with pytest.raises(ValueError, match="nnodes=2 needs rdzv_endpoint"):
        launch_command("EX", "CKPT", 4, 7, nnodes=2)
    cmd = launch_command("EX", "CKPT", 4, 7, tsp=8, nnodes=2, rdzv_endpoint="head:29500", rdzv_id="job1")
    assert cmd[3:13] == ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "head:29500", "--rdzv-id", "job1"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_slurm_template_is_valid_bash():
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash")
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # the knobs it hands the orchestrator and the manual form are both there
    for s in ("#SBATCH --nodes=2", "trainer.nnodes=2", "trainer.rdzv_endpoint=", "rollout.urls=",
              "--rdzv-backend c10d", "-m train.rl.worker", "--weights-dir", "--api-key"):
        assert s in text, s
