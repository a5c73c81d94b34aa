"""Scaling out: the RL trainer worker across two "nodes" simulated on 127.0.0.1, the SLURM
template, and ``cascade calc rollout`` sizing.

Two torchrun agents (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous at 127.0.0.1:PORT, each
agent its own process tree as on two hosts; their logs show one global rank each) run
``-m train.rl.worker`` on one shared exchange directory; the mesh (TSP 2, or DP 2) spans both
agents. Three batches are written while they run; the worker must consume them, publish versions
1..3 and end with the weights of the single-process reference
(train.parallel.rl_update.reference_update) within 1e-5. gloo on CPU; real hosts and NCCL are not
covered.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cascade.learner import kill_tree
from train.parallel.comm import free_port

from tests.test_rl_distributed import (ROOT, TOL, _final_weights, _finish, _max_err, _start_worker, rl_cfg,
                                       worker_setup)  # noqa: F401  (worker_setup is a fixture)

SBATCH = ROOT / "scripts" / "slurm" / "cascade_rl.sbatch"


def _start_two_nodes(exchange: Path, model_dir: Path, steps: int, tsp: int, dp: int):
    """Two torchrun agents, one rank each, meeting at one c10d rendezvous endpoint."""
    from train.rl.worker import config_dict, launch_command

    cfg_path = exchange.parent / "rl.json"
    cfg_path.write_text(json.dumps(config_dict(rl_cfg("dppo_tv"))))
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"scale-out-{time.time_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LOGLEVEL="INFO")  # agents log rendezvous
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
                kill_tree(proc.pid)
                proc.wait()
            log.close()
    assert complete_versions(ex) == [1, 2, 3]
    metrics = [json.loads((ex / "metrics" / f"step-{i:06d}.json").read_text()) for i in range(3)]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert _max_err(load_version(ex, 3)[1], ref3) < TOL
    assert _max_err(_final_weights(ex), ref3) < TOL
    logs = [(ex.parent / f"node{n}.log").read_text() for n in range(2)]
    start = [json.loads(line) for text in logs for line in text.splitlines() if line.startswith('{"worker": "start"')]
    assert len(start) == 1 and (start[0]["tsp"], start[0]["dp"]) == (tsp, dp), logs  # global rank 0 prints
    # each agent's rendezvous result: one group of two agents, global rank 0 in one and 1 in the other
    found = [(re.findall(r"group_world_size=(\d+)", t), re.findall(r"global_ranks=\[(\d+)\]", t)) for t in logs]
    assert all(gws == ["2"] for gws, _ in found), found
    assert sorted(r for _, ranks in found for r in ranks) == ["0", "1"], found


@pytest.mark.timeout(300)
def test_a_worker_resumed_by_hand_drops_what_it_did_past_its_checkpoint(worker_setup):  # noqa: F811
    """``-m train.rl.worker`` with no orchestrator, resumed from its checkpoint of update 1 after it had run
    on (versions 2-4 and the metrics of updates 1-3 on disk): those are removed at its start, so version 2
    written again is the newest version, kept, rather than pruned below the stale 3 and 4."""
    import torch

    from train.rl.exchange import complete_versions, load_version, publish_version, write_batch

    root, batches, _ = worker_setup
    ex = root / "resumed_by_hand" / "exchange"
    ex.mkdir(parents=True)
    write_batch(ex, batches[0])
    _finish(*_start_worker(ex, root / "init", 1, tsp=1, dp=1, extra=["--checkpoint-every", "1"]))
    for v in (2, 3, 4):  # the run went on past its last checkpoint
        publish_version(ex, v, {"w": torch.zeros(2)}, keep=0)
        (ex / "metrics" / f"step-{v - 1:06d}.json").write_text("{}")
    write_batch(ex, batches[1])
    _finish(*_start_worker(ex, root / "init", 2, tsp=1, dp=1))
    assert complete_versions(ex) == [1, 2] and "w" not in load_version(ex, 2)[1]
    assert sorted(p.name for p in (ex / "metrics").iterdir()) == ["step-000000.json", "step-000001.json"]
    assert json.loads((ex / "metrics" / "step-000001.json").read_text())["version"] == 2


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


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_node_1_runs_only_the_trainer_commands_written_in_this_job(tmp_path):
    """A job requeued with the same OUT: a finished stage's trainer-command.txt is still there, written before this
    job started. Node 1's loop (run here as the template has it) skips it and runs the current stage's command only;
    it ran the finished stage's old torchrun first, which went to the rendezvous of node 0's agent of the current
    stage. The template marks the job's start before node 1's loop and before the orchestrator starts."""
    import shlex

    text = SBATCH.read_text()
    loop = re.search(r"\n    srun [^\n]*bash -c '\n(.*?)' \"\$OUT\" &\n", text, re.S)
    assert loop, "node 1's loop: srun ... bash -c '...' \"$OUT\" &"
    out, ran = tmp_path / "out", tmp_path / "ran"
    old, new = (out / "stages" / n / "logs" / "trainer-command.txt" for n in ("1-warmup", "2-math"))
    for f in (old, new):
        f.parent.mkdir(parents=True)
    now = time.time()
    old.write_text(f"echo 1-warmup >> {shlex.quote(str(ran))}\n")
    os.utime(old, (now - 3600, now - 3600))  # the job before the requeue ran stage 1
    (out / ".node1-start").touch()
    os.utime(out / ".node1-start", (now - 60, now - 60))  # this job started
    new.write_text(f"echo 2-math >> {shlex.quote(str(ran))}; touch {shlex.quote(str(out / '.orchestrator-done'))}\n")
    r = subprocess.run(["bash", "-c", loop.group(1), str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ran.read_text() == "2-math\n"
    marked = text.index('touch "$OUT/.node1-start"')
    assert marked < loop.start() < text.index("    cascade run out=")


# ------------------------------------------------------------------- cascade calc rollout sizing


def test_rollout_sizing_hand_values():
    from train.parallel.calc import rollout_sizing

    # measured rates: 4 prompts x 8 = 32 completions of 100 + 400 tokens
    r = rollout_sizing(1e9, prompts=4, group=8, prompt_len=100, response_len=400, gen_tps=1000, train_tps=4000,
                       trainer_ranks=2)
    assert r["gen_tokens_per_step"] == 32 * 400 == 12800 and r["train_tokens_per_step"] == 32 * 500 == 16000
    assert r["servers_per_rank"] == pytest.approx(12800 / 16000 * 4000 / 1000) == pytest.approx(3.2)
    assert r["servers_needed"] == r["servers"] == 7  # ceil(3.2 x 2 ranks)
    assert r["gen_tps_total"] == 7000 and r["train_tps_total"] == 8000
    assert r["gen_s_per_step"] == pytest.approx(12800 / 7000) and r["train_s_per_step"] == pytest.approx(2.0)
    assert r["step_s_sync"] == pytest.approx(12800 / 7000 + 2.0) and r["step_s_pipelined"] == pytest.approx(2.0)
    assert r["bottleneck"] == "trainer" and (r["gen_tps_source"], r["train_tps_source"]) == ("measured",) * 2
    assert "assumptions" not in r
    # fewer servers than needed: generation is the bottleneck
    r = rollout_sizing(1e9, 4, 8, 100, 400, gen_tps=1000, train_tps=4000, trainer_ranks=2, servers=4)
    assert (r["servers"], r["servers_needed"], r["bottleneck"]) == (4, 7, "generation")
    assert r["gen_s_per_step"] == pytest.approx(3.2) and r["step_s_pipelined"] == pytest.approx(3.2)
    # assumed rates: t = 0.3 x 1e15 / (6 x 1e9) = 5e4, g = 0.1 x 1e15 x 2 GPUs / (2 x 1e9) = 1e5
    r = rollout_sizing(1e9, 1, 1, 0, 1000, trainer_ranks=8, gpus_per_server=2, peak_tflops=1000, train_mfu=0.3,
                       gen_mfu=0.1, total_params=4e9, weight_bytes=2)
    assert r["train_tps_per_rank"] == pytest.approx(5e4) and r["gen_tps_per_server"] == pytest.approx(1e5)
    assert r["servers_per_rank"] == pytest.approx(0.5) and r["rollout_gpus_per_trainer_gpu"] == pytest.approx(1.0)
    assert r["servers_needed"] == 4 and r["weight_bytes_per_version"] == 8e9
    assert (r["gen_tps_source"], r["assumptions"]["gen_mfu"]) == ("assumed", 0.1)


def test_rollout_sizing_edges_hand_values():
    """A server count that is a whole number up to float rounding is not rounded up: 300 of 1,000 tokens
    generated, 7,000 trained vs 3,000 generated tokens/s: 0.3 x 7/3 = 0.7 servers per rank, 7 for 10 ranks
    (0.3 x 7/3 x 10 is 7.000000000000001 in floats); one assumed rate is labelled as an assumption; an infinite
    prompt length is refused; every count suffix."""
    from train.parallel.calc import parse_count, rollout_sizing

    r = rollout_sizing(1e9, 1, 1, 700, 300, gen_tps=3000, train_tps=7000, trainer_ranks=10)
    assert r["servers_per_rank"] == pytest.approx(0.7) and r["servers_needed"] == r["servers"] == 7
    r = rollout_sizing(1e9, 4, 8, 100, 400, gen_tps=1000, trainer_ranks=2)  # the trainer's rate assumed
    assert (r["gen_tps_source"], r["train_tps_source"]) == ("measured", "assumed") and "assumptions" in r
    r = rollout_sizing(1e9, 4, 8, 100, 400, train_tps=4000, trainer_ranks=2)  # the servers' rate assumed
    assert (r["gen_tps_source"], r["train_tps_source"]) == ("assumed", "measured") and "assumptions" in r
    with pytest.raises(ValueError, match="prompt_len"):
        rollout_sizing(1e9, 4, 8, float("inf"), 400)
    assert [parse_count(t, "--p") for t in ("4K", "4k", "2G", "1.5T", "3m")] == [4e3, 4e3, 2e9, 1.5e12, 3e6]
    for bad in ("inf", "1e999", "2e400B"):
        with pytest.raises(ValueError, match="--p: expected a positive number"):
            parse_count(bad, "--p")


def test_active_parameters_and_counts():
    from tests.test_rl_distributed import _cfgs
    from train.parallel.calc import active_parameters, parse_count

    dense, moe = _cfgs()["dense"], _cfgs()["moe"]
    assert active_parameters(dense) == dense.num_parameters()
    # one MoE layer: 2 of its 4 experts (3 x 32 x 18 each) are idle for a token
    assert moe.num_parameters() - active_parameters(moe) == 2 * 3 * 32 * 18
    assert (parse_count("8B", "--p"), parse_count("760M", "--p"), parse_count("1.5e9", "--p")) == (8e9, 7.6e8, 1.5e9)
    for bad in ("8x", "-1", "0", "", "nanB"):
        with pytest.raises(ValueError, match="--p: expected a positive number"):
            parse_count(bad, "--p")


def test_calc_takes_a_zaya_preset_as_zaya(capsys, tmp_path):
    """A zaya preset is read as zaya (its model_type gave the family only in init_model: calc built a qwen3 config
    and failed on its partial rotary embeddings); its active parameters are what a token passes through, counted
    from the built model's tensors; the layout table, which models Qwen-style attention, refuses it in one line."""
    from cascade.cli import main as cascade
    from train.model.config import ModelConfig
    from train.parallel.calc import main
    from train.presets import init_model

    model, _ = init_model("tiny-zaya", tmp_path / "m")
    c = model.config
    held = sum(p.numel() for p in model.parameters())
    idle = sum(p[c.num_experts_per_tok:].numel() for n, p in model.named_parameters() if ".experts." in n)
    assert main(["rollout", "--preset", "tiny-zaya", "--prompts", "4", "--group", "2", "--prompt-len", "32",
                 "--response-len", "64", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["total_params"], r["active_params"]) == (held, held - idle)
    assert cascade(["calc", "--preset", "tiny-zaya", "--seq", "64", "--D", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cascade calc: error: the layout table models") and err.count("\n") == 1, err
    # a MoE given without its experts' width was counted with experts of width 0
    assert cascade(["calc", "--hidden", "64", "--layers", "2", "--heads", "4", "--experts", "4", "--seq", "128",
                    "--D", "2"]) == 2
    err = capsys.readouterr().err
    assert "--moe-ffn (the experts' width, with --experts) missing" in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match="needs moe_intermediate_size >= 1"):
        ModelConfig(num_experts=4, moe_intermediate_size=0).validate()


def test_calc_rollout_cli_json_and_one_line_errors(capsys):
    from cascade.cli import main as cascade
    from train.model.config import ModelConfig
    from train.parallel.calc import active_parameters, main
    from train.presets import load_preset

    base = ["rollout", "--prompts", "4", "--group", "8", "--prompt-len", "100", "--response-len", "400"]
    assert main(base + ["--params", "8B", "--active-params", "1B", "--gen-tps", "1000", "--train-tps", "4000",
                        "--trainer-ranks", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["servers_needed"], r["total_params"], r["active_params"]) == (7, 8e9, 1e9)
    assert main(base + ["--preset", "small-moe"]) == 0  # text form; the model from a preset
    text = capsys.readouterr().out
    m = dict(load_preset("small-moe")["model"])
    m.setdefault("vocab_size", load_preset("small-moe")["tokenizer"]["vocab_size"])
    cfg = ModelConfig.from_dict(m)
    assert f"{active_parameters(cfg) / 1e6:.3g}M active" in text and "ASSUMED rates" in text
    assert "rollout servers per trainer rank to keep up:" in text
    for args, msg in ((["--params", "8x"], "--params: expected a positive number"),
                      (["--params", "8B", "--prompts", "0"], "prompts (--prompts) must be > 0, got 0"),
                      (["--params", "8B", "--gen-tps", "abc"], "argument --gen-tps: invalid float value"),
                      (["--params", "8B", "--active-params", "9B"], "exceeds --params"),
                      (["--params", "8B", "--preset", "small-moe"], "not both"),
                      (["--params", "8B", "--experts", "64", "--topk", "8"], "not both"),  # a sparse model's sizes
                      (["--params", "8B", "--bytes", "0"], "bytes (--bytes) must be > 0, got 0"),
                      ([], "give the model"),
                      (["--params", "8B", "--bogus"], "unrecognized arguments: --bogus")):
        assert cascade(["calc"] + base + args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("cascade calc: error: ") and msg in err and err.count("\n") == 1, (args, err)
