"""`cascade run` with its three roles in separate processes: rollout servers (`rollout.servers`),
trainer ranks under torchrun on the sharded core (`trainer.nproc`, `trainer.tsp`) and the
orchestrator, on 127.0.0.1 with gloo; faults (kill -9 of a server, of the whole run) and bad
layouts.

The policy is the warm-started tiny dense model of tests/test_rl_loop.py (SFT on toy/max), so
groups have mixed rewards and every update moves the weights.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import alive, cascade_here, wait_until
from tests.test_rl_loop import one_thread  # noqa: F401 (fixture)

STAGE = ["stage=rlve", "profile=tiny", "logging.progress=false", "envs={toy/max: 1}", "controller=fixed",
         "controller_kwargs={difficulty: 1}", "rl.chat_template=false", "rl.sampling.max_new_tokens=10",
         "rl.dynamic_sampling=false", "rl.length_reward=false", "rl.optim.lr=1e-3", "rl.optim.warmup_steps=0",
         "eval_problems=8", "checkpoint_every=2"]


@pytest.fixture(scope="module")
def warm_dir(warm, tmp_path_factory):
    from train.model.hf_io import save_pretrained

    _, tok, model = warm
    d = tmp_path_factory.mktemp("warm-policy")
    save_pretrained(model, d, tokenizer=tok)
    return d


def cascade(*args, env=None, timeout=600, wait=True, cwd=None):
    e = dict(os.environ, **(env or {}))
    cmd = [sys.executable, "-m", "cascade", "run", *args]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd)


def rl_records(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]


def wait_for_rl_records(p, out, n: int) -> None:
    """Until the run ``p`` writing to ``out`` has recorded ``n`` RL steps (or ended; at most 300 s)."""
    wait_until(lambda: p.poll() is not None or (out / "metrics.jsonl").exists() and len(rl_records(out)) >= n,
               300, every=0.2)


def final_weights(out):
    from train.model.hf_io import read_state_dict

    return read_state_dict(out / "stages" / "1-rlve" / "final")


@pytest.mark.parametrize("transport", ["files", "broadcast"])
def test_servers_and_trainer_ranks_run_a_stage(warm_dir, tmp_path, transport):
    """Two rollout servers, two TSP trainer ranks: every step's behaviour log-probs equal the trainer's
    (the servers serve exactly the weights the ranks published: read from the files, or broadcast over
    a gloo weight group by the cascade process), the policy moves, and the final checkpoint holds the
    ranks' final weights. Nothing is left running. The broadcast run also takes a KL penalty
    (rl.loss_cfg.kl_coef > 0) on the ranks: the reference is the policy at the RL start (k3 is 0 at the
    first update, > 0 once the policy moved), the ranks report kl_ref, and their checkpoints hold the
    frozen reference. The files run names its out= and model= relative to where it starts (the ranks and
    servers run elsewhere)."""
    out = tmp_path / "run"
    kl = ["rl.loss_cfg.kl_coef=0.5"] if transport == "broadcast" else []
    where = ["out=run", f"model={os.path.relpath(warm_dir, tmp_path)}"] if transport == "files" else [
        f"out={out}", f"model={warm_dir}"]
    r = cascade(*where, *STAGE, "steps=3", "rollout.servers=2", "trainer.nproc=2", "trainer.tsp=2",
                f"rollout.weight_transport={transport}", *kl, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = rl_records(out)
    assert len(recs) == 3 and all(x["groups_trained"] == 8 for x in recs)
    assert all(x["mismatch_kl"] < 1e-6 and x["version_lag_max"] == 0 for x in recs), recs
    if transport == "broadcast":
        assert all(x["weight_broadcast_failures"] == 0 for x in recs), recs
        assert all("kl_ref" in x for x in recs), recs
        assert abs(recs[0]["kl_ref"]) < 1e-6 and recs[-1]["kl_ref"] > 1e-7, [x["kl_ref"] for x in recs]
        metas = [json.loads(p.read_text()) for p in (out / "exchange" / "trainer_ckpt").glob("step-*/meta.json")]
        assert metas and all(m["kl_reference"] is True for m in metas)
    assert all(x["grad_norm"] > 0 for x in recs)
    from train.model.hf_io import read_state_dict

    fin, ranks = final_weights(out), read_state_dict(out / "exchange" / "final")
    start = read_state_dict(warm_dir)
    assert set(fin) == set(ranks)
    assert all(torch.equal(fin[k], ranks[k]) for k in fin)
    assert any(not torch.equal(fin[k], start[k]) for k in fin)
    pids = json.loads((out / "stages" / "1-rlve" / "logs" / "servers.json").read_text()).values()
    assert not any(alive(p) for p in pids)


def test_a_stage_that_sends_the_ranks_no_update_ends_cleanly(warm_dir, tmp_path):
    """Every group dropped (a policy that cannot answer in 2 tokens: reward 0 everywhere), so no batch
    reaches the ranks: the stage still ends, with the starting weights as its final checkpoint (it
    failed writing the ranks' stop file into an exchange directory nothing had created)."""
    out = tmp_path / "run"
    r = cascade(f"out={out}", f"model={warm_dir}", *STAGE, "steps=2", "rl.sampling.max_new_tokens=2",
                "rl.dynamic_sampling=true",
                "eval_problems=2", "trainer.nproc=2", "trainer.tsp=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["groups_trained"] for x in rl_records(out)] == [0, 0]
    fin = final_weights(out)
    from train.model.hf_io import read_state_dict

    start = read_state_dict(warm_dir)
    assert all(torch.equal(fin[k], start[k]) for k in start)


def test_kill_9_of_a_server_mid_run(warm_dir, tmp_path):
    """All three roles pipelined (two servers, two trainer ranks, ``rl.max_staleness=1``), and a rollout
    server killed mid-run: its prompts go to the other, it is restarted (catching up to the newest
    weights), the run completes; trained groups lag the policy (the pipeline overlaps) but never by
    more than one version, the ratio is taken against the behaviour log-probs (not identically 1), and
    the stage's final checkpoint holds the ranks' final weights."""
    out = tmp_path / "run"
    p = cascade(f"out={out}", f"model={warm_dir}", *STAGE, "steps=5", "rollout.servers=2", "rl.max_staleness=1",
                "trainer.nproc=2", "trainer.tsp=1", wait=False)
    servers = out / "stages" / "1-rlve" / "logs" / "servers.json"
    wait_for_rl_records(p, out, 1)  # (the servers are up, and servers.json written, before the first step)
    victim = list(json.loads(servers.read_text()).values())[0]
    os.kill(victim, signal.SIGKILL)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    recs = rl_records(out)
    assert len(recs) == 5 and recs[-1]["server_restarts"] >= 1 and recs[-1]["servers_up"] == 2
    assert all(x["version_lag_max"] <= 1 for x in recs) and any(x["version_lag_max"] == 1 for x in recs), recs
    assert any(x["mismatch_kl"] > 1e-6 and x["ratio_mean"] != 1.0 for x in recs if x["version_lag_max"]), recs
    assert victim not in json.loads(servers.read_text()).values()
    from train.model.hf_io import read_state_dict

    fin, ranks = final_weights(out), read_state_dict(out / "exchange" / "final")
    assert set(fin) == set(ranks) and all(torch.equal(fin[k], ranks[k]) for k in fin)


def test_sigterm_stops_a_run_like_ctrl_c(warm_dir, tmp_path):
    """SIGTERM (a scheduler's preemption or time limit) unwinds ``cascade run`` as Ctrl-C does: its rollout
    server is stopped by the run, the command says so in one line with the resume hint and exits 143 (the
    default action ended it at once, exit -15, with no word), and the last complete checkpoint is kept."""
    out = tmp_path / "run"
    p = cascade(f"out={out}", f"model={warm_dir}", *STAGE, "steps=40", "rollout.servers=1", wait=False)
    wait_for_rl_records(p, out, 3)
    pids = json.loads((out / "stages" / "1-rlve" / "logs" / "servers.json").read_text()).values()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, (p.returncode, err[-3000:])
    assert err.strip().splitlines() == ["cascade run: terminated (SIGTERM); the same command resumes from the last "
                                        "complete checkpoint"], err[-3000:]
    assert not any(alive(x) for x in pids)
    assert list((out / "stages" / "1-rlve" / "checkpoints").glob("step-*/COMPLETE"))


def _rank_pids(out, agent: bool = False) -> list[int]:
    """The trainer ranks of the run at ``out`` (train.rl.worker processes; with ``agent``, their torchrun
    agent too). A zombie's cmdline reads empty: only live processes are listed."""
    want = f"--exchange\0{out / 'exchange'}\0"
    pids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{d}/cmdline").read()
        except OSError:
            continue
        if want in cmd and (agent or "\0-u\0-m\0train.rl.worker\0" in cmd):
            pids.append(int(d))
    return sorted(pids)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "hung"])
def test_one_trainer_rank_killed_or_hung_fails_the_run_and_no_rank_is_left(warm_dir, tmp_path, sig):
    """One trainer rank killed mid-run (torchrun stops the other: the run fails at once) or stopped
    (SIGSTOP: a hung GPU, a frozen host; the other rank blocks in a collective with it: the run fails
    after ``trainer.timeout_s`` of silence). The command's first line says which and names the ranks'
    log, the last complete checkpoint is kept (the same command resumes it, as the test below shows),
    and no rank is left: the torchrun agent and every rank are killed (torchrun puts each rank in a
    session of its own, out of the agent's process group: hung ones were left behind before)."""
    out = tmp_path / "run"
    # the ranks' start (several seconds here) is bounded by trainer.startup_timeout_s, not by the 8 s of silence
    hung = ["trainer.timeout_s=8", "trainer.startup_timeout_s=100"] if sig == signal.SIGSTOP else []
    p = cascade(f"out={out}", f"model={warm_dir}", *STAGE, "steps=40", "trainer.nproc=2", *hung, wait=False)
    wait_for_rl_records(p, out, 3)
    ranks = _rank_pids(out)
    assert len(ranks) == 2, (ranks, p.poll() is None or p.communicate()[1][-3000:])
    if hung:  # the ranks' collectives (their first too) wait a minute longer than the orchestrator waits for them
        assert "--timeout-s 160.0" in (out / "stages" / "1-rlve" / "logs" / "trainer-command.txt").read_text()
    os.kill(ranks[1], sig)
    t1 = time.monotonic()
    try:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1 and time.monotonic() - t1 < 60, err[-3000:]
        first = err.strip().splitlines()[0]
        why = "sent nothing for 8 s (trainer.timeout_s)" if hung else "exited"
        assert first.startswith(f"cascade run: failed: the trainer ranks {why}") and "trainer.log" in first, first
        assert err.strip().endswith("; the same command resumes from the last complete checkpoint")
        assert list((out / "stages" / "1-rlve" / "checkpoints").glob("step-*/COMPLETE"))
        wait_until(lambda: not any(alive(r) for r in ranks), 10)
        assert not any(alive(r) for r in ranks)
    finally:
        for r in ranks:
            if alive(r):
                os.kill(r, signal.SIGKILL)


def test_the_ranks_start_is_bounded_by_the_startup_timeout_and_later_silence_by_the_timeout(tmp_path):
    """``trainer.timeout_s`` bounds the silence of ranks that answered once; their first answer (torch's
    import, the rendezvous, loading the model) may take up to ``trainer.startup_timeout_s``, and a start
    that takes longer fails naming that setting."""
    from types import SimpleNamespace

    from cascade.config import Trainer
    from cascade.learner import WorkerLearner
    from train.errors import RunFailure

    def learner(timeout, startup):
        w = object.__new__(WorkerLearner)
        w.proc, w.log, w._silent, w._up = SimpleNamespace(poll=lambda: None), tmp_path / "trainer.log", False, False
        w.timeout, w.startup_timeout = timeout, max(timeout, startup)
        return w

    def after(s):
        t0 = time.monotonic()
        return lambda: time.monotonic() - t0 > s

    w = learner(0.2, 5)
    w._wait("the metrics of update 0", after(0.6))  # a start three times the silence allowed
    with pytest.raises(RunFailure, match=r"sent nothing for 0 s \(trainer.timeout_s\) while the orchestrator waited "
                                         r"for the metrics of update 1"):
        w._wait("the metrics of update 1", after(0.6))
    assert w._silent
    with pytest.raises(RunFailure, match=r"sent nothing for 0 s \(trainer.startup_timeout_s: their start\)"):
        learner(0.1, 0.3)._wait("the metrics of update 0", after(5))
    with pytest.raises(ValueError, match="trainer.timeout_s and trainer.startup_timeout_s must be >= 0"):
        Trainer(startup_timeout_s=-1)


def test_the_ranks_checkpoint_an_update_after_the_orchestrators_previous_checkpoint_is_written(tmp_path,
                                                                                             monkeypatch):
    """StageRunner.save asks the ranks for their checkpoint of update 2 only once the orchestrator's checkpoint of
    update 1, written in the background (slowly here, as a large model's), is complete: the ranks prune theirs to
    the newest few as they write, and a run killed while the orchestrator still wrote 1 resumed from its 0, which
    the ranks no longer had. The ranks here answer each request as train.rl.worker does (the version, then the
    request file removed), noting which orchestrator checkpoints were complete when it came."""
    import threading
    from types import SimpleNamespace

    import cascade.checkpoint as ck
    from cascade.config import RunConfig, StageConfig, Trainer
    from cascade.learner import WorkerLearner
    from cascade.stage import StageRunner
    from train.model.config import ModelConfig
    from train.model.modeling import CausalLM
    from train.rl.exchange import publish_version
    from train.rl.worker import request_path

    policy = CausalLM(ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)).init_weights(0, std=0.2)
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer_config.json").write_text("{}")
    copy = ck.copy_tokenizer

    def slow_copy(s, d):  # the orchestrator's write of update 1 takes a second
        if d.name == "step-00000001.tmp":
            time.sleep(1.0)
        copy(s, d)

    monkeypatch.setattr(ck, "copy_tokenizer", slow_copy)
    ckpt = ck.Checkpointer(tmp_path / "checkpoints")
    exchange = tmp_path / "exchange"
    learner = object.__new__(WorkerLearner)
    learner.exchange, learner.sft_steps, learner.log = exchange, 0, tmp_path / "trainer.log"
    learner.proc, learner._silent, learner._up = SimpleNamespace(poll=lambda: None), False, True
    learner.timeout = learner.startup_timeout = 30
    seen, stop = {}, threading.Event()

    def ranks():
        while not stop.is_set():
            for u in (1, 2):
                req = request_path(exchange, u)
                if u not in seen and req.exists():
                    seen[u] = [p.name for p in ckpt.complete()]
                    publish_version(exchange, u, policy.state_dict())
                    req.unlink()
            time.sleep(0.01)

    t = threading.Thread(target=ranks, daemon=True)
    t.start()
    try:
        rcfg = RunConfig(order=["rlve"], stages={"rlve": StageConfig()}, trainer=Trainer(nproc=2))
        runner = StageRunner("rlve", 1, rcfg.stages["rlve"], rcfg, tmp_path, records=None)
        rl = SimpleNamespace(learner=learner, step_idx=1, state_dict=lambda: {})
        for u in (1, 2):
            rl.step_idx = u
            runner.save(ckpt, policy, src, rl, None, None, {"step": u})
        ckpt.wait()
    finally:
        stop.set()
        t.join()
    assert seen == {1: [], 2: ["step-00000001"]}
    assert [p.name for p in ckpt.complete()] == ["step-00000001", "step-00000002"]


def _launch(tmp_path, tcfg, start_update: int):
    """The ranks started at ``start_update`` and killed at once (they wait at the rendezvous for another node):
    their command, split, and whether it was still in the stage's logs before they were stopped."""
    import shlex

    from cascade.learner import WorkerLearner
    from train.rl.trainer import RLConfig

    logs = tmp_path / "stages" / "1-rlve" / "logs"
    w = WorkerLearner(tmp_path / "exchange", tmp_path / "model", tcfg, RLConfig(), 5, start_update, logs)
    try:
        return shlex.split((logs / "trainer-command.txt").read_text())
    finally:
        w._silent = True  # killed, not asked to stop
        w.close()


def test_the_ranks_keep_one_checkpoint_more_than_the_orchestrator(tmp_path):
    """The orchestrator keeps its 2 newest checkpoints and falls back to the one before its newest when that one
    does not read back: the ranks keep 3, so the update it falls back to is still theirs."""
    from cascade.checkpoint import Checkpointer
    from cascade.config import Trainer

    cmd = _launch(tmp_path, Trainer(nproc=1, nnodes=2, rdzv_endpoint="127.0.0.1:1"), 0)
    assert Checkpointer(tmp_path / "checkpoints").keep == 2
    assert int(cmd[cmd.index("--keep-checkpoints") + 1]) == 3


def test_each_launch_of_the_ranks_has_a_rendezvous_of_its_own(tmp_path):
    """Two launches of a stage's ranks at the same update (a job requeued with the same OUT) meet under different
    rendezvous ids (trainer.rdzv_id, the stage, the update, a random part): a node that ran an earlier launch's
    command does not join this one. The command, which every node runs, is removed when the ranks are stopped."""
    from cascade.config import Trainer

    (tmp_path / "exchange" / "trainer_ckpt" / "step-000003").mkdir(parents=True)
    (tmp_path / "exchange" / "trainer_ckpt" / "step-000003" / "COMPLETE").write_text("ok\n")
    tcfg = Trainer(nproc=1, nnodes=2, rdzv_endpoint="127.0.0.1:1", rdzv_id="job7")
    ids = []
    for _ in range(2):
        cmd = _launch(tmp_path, tcfg, 3)
        ids.append(cmd[cmd.index("--rdzv-id") + 1])
        assert not (tmp_path / "stages" / "1-rlve" / "logs" / "trainer-command.txt").exists()
    assert ids[0] != ids[1] and all(i.startswith("job7-1-rlve-3-") for i in ids), ids


def test_a_bf16_stage_resumed_inside_or_after_its_sft_warm_up_ends_as_an_uninterrupted_one(warm_dir, tmp_path):
    """In this process (no ranks), dtype=bfloat16, 2 SFT steps then 3 RL steps, killed after SFT step 1 or after an
    RL step and resumed: the same final weights as the run that was not interrupted. Each optimizer puts its fp32
    masters into the weights as it loads; the phase that trained last must load last (the SFT optimizer's masters
    loaded after the RL one's put the weights back where SFT had left them; the RL one's, loaded last inside SFT, put
    them back to the stage's start)."""
    args = [f"model={warm_dir}", *STAGE, "steps=3", "checkpoint_every=1", "dtype=bfloat16", "sft.steps=2",
            "sft.examples=32", "sft.batch_size=8", "sft.max_len=128", "sft.optim.lr=1e-3",
            "sft.optim.warmup_steps=0"]  # (a section override keeps the rest of its default: warm-up 10)
    ref, out = _uninterrupted_and_resumed(tmp_path, args, "before_checkpoint:4")
    a, b = final_weights(ref), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    out = _uninterrupted_and_resumed(tmp_path, args, "before_checkpoint:2", ref=ref, out=tmp_path / "inside")[1]
    b = final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _uninterrupted_and_resumed(tmp_path, args, fault: str, ref=None, out=None):
    """The run of ``args`` once through (``ref``; given: already run) and once killed at ``fault`` then resumed
    (``out``)."""
    if ref is None:
        ref = tmp_path / "ref"
        assert cascade(f"out={ref}", *args).returncode == 0
    out = out or tmp_path / "run"
    r = cascade(f"out={out}", *args, env={"CASCADE_FAULT": fault})
    assert r.returncode == -signal.SIGKILL
    r = cascade(f"out={out}", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return ref, out


def test_a_resume_between_weight_syncs_samples_from_the_weights_the_run_would_have(warm_dir, tmp_path):
    """rl.sync_every=2 with a checkpoint after step 1: the engine of the run that went on still held version 0,
    while a run resumed from that checkpoint synced the engine to version 1 (its rollouts differed from step 1 on:
    lag 0 against 1, other samples). A checkpoint now gives the engine the weights it saves: the resumed run's
    records and final weights equal the uninterrupted run's."""
    from cascade.records import read_records

    args = [f"model={warm_dir}", *STAGE, "steps=3", "checkpoint_every=1", "rl.sync_every=2"]
    ref, out = _uninterrupted_and_resumed(tmp_path, args, "before_checkpoint:2")
    keys = ("version_lag_max", "reward_mean", "loss", "grad_norm", "entropy", "response_len")
    recs = [{x["step"]: tuple(x.get(n) for n in keys) for x in read_records(d) if x["phase"] == "rl"} for d in (ref, out)]
    assert sorted(recs[0]) == [0, 1, 2] and recs[1] == recs[0], recs
    a, b = final_weights(ref), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_kill_9_of_the_run_resumes_trainer_ranks_and_orchestrator_in_step(warm_dir, tmp_path):
    """A stage of 3 SFT steps then 3 RL steps, both on the trainer ranks. The whole run SIGKILLed
    just before the checkpoint of step 4 (trainer ranks notice and stop): rerunning resumes
    orchestrator and ranks from step 2, inside SFT (model, optimizer, curriculum, RNG), and ends
    with the same weights as an uninterrupted run, also when the rerun puts the two ranks on
    another mesh (DP 2 -> TSP 2: the ranks reshard the checkpoint). No rank or torchrun agent outlives the
    killed orchestrator."""
    args = [f"model={warm_dir}", *STAGE, "steps=3", "trainer.nproc=2", "trainer.tsp=1", "sft.steps=3",
            "sft.examples=64", "sft.batch_size=8", "sft.max_len=128", "sft.optim.lr=1e-3",
            "sft.optim.warmup_steps=0"]  # (a section override keeps the rest of its default: warm-up 10)
    ref, out = tmp_path / "ref", tmp_path / "run"
    r = cascade(f"out={ref}", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cascade(f"out={out}", *args, env={"CASCADE_FAULT": "before_checkpoint:4"})
    assert r.returncode == -signal.SIGKILL
    wait_until(lambda: not _rank_pids(out, agent=True), 30, every=0.2)  # orphaned ranks and agent exit
    assert not _rank_pids(out, agent=True)
    assert not (out / "exchange" / "final").exists()
    r = cascade(f"out={out}", *[x.replace("trainer.tsp=1", "trainer.tsp=2") for x in args])
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "stages" / "1-rlve" / "logs" / "trainer.log").read_text()
    assert '"worker": "start", "step": 2, "dp": 1, "tsp": 2' in log, log[-3000:]
    a, b = final_weights(ref), final_weights(out)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    sft = [x for x in recs if x["phase"] == "sft"]
    assert [x["step"] for x in sft] == [0, 1, 2, 2] and all(x["sft_loss"] > 0 and x["grad_norm"] > 0 for x in sft)
    assert [x["step"] for x in rl_records(out)][-3:] == [3, 4, 5]  # stage steps: RL follows SFT


@pytest.mark.parametrize("args,needle", [
    (["trainer.nproc=2", "trainer.tsp=4"], "trainer.tsp=4 does not divide the trainer's world size 2"),
    (["trainer.nproc=3", "trainer.tsp=3"], "trainer.tsp=3 does not fit the policy: TSP needs num_attention_heads"),
    (["trainer.nnodes=2"], "trainer.nnodes > 1 needs trainer.rdzv_endpoint"),
    (["rollout.urls=[http://127.0.0.1:9]", "rollout.api_key=k"], "rollout.urls: cannot reach rollout server "
                                                                  "http://127.0.0.1:9"),
    (["rollout.servers=1", "rollout.urls=[http://127.0.0.1:9]"], "not both"),
    (["rollout.servers=-1"], "rollout.servers must be >= 0, got -1"),
    (["trainer.tsp=0"], "trainer.tsp must be >= 1, got 0"),
    (["rollout.down_wait_s=-1"], "rollout.down_wait_s >= 0, got 120.0, 10.0 and -1"),
    (["rollout.servers=2", "rollout.gpus=[0,1,2]"], "rollout.gpus=[0, 1, 2] must be distinct GPU ids, as many for each"),
    (["trainer.nproc=2", "rl.updates_per_batch=2"], "the trainer ranks take one optimizer step per"),
    (["rl.loss_cfg.tis_cap=2"], "rl: loss_cfg.tis_cap=2.0 acts only with ratio_against=recompute"),
    (["env_kwargs.toy/max.max_digitz=3"], "stages.rlve.env_kwargs.toy/max: toy/max takes no setting max_digitz"),
    (["env_kwargs.toy/add.digits=3"],
     "stages.rlve.env_kwargs.toy/add: toy/add is not in the stage's mix or sft.envs (toy/max)"),
])
def test_bad_layouts_fail_before_any_work(warm_dir, tmp_path, args, needle):
    out = tmp_path / "run"
    r = cascade_here("run", f"out={out}", f"model={warm_dir}", *STAGE, *args)  # the entry point's code, in this process
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert not list((out / "stages").glob("*/checkpoints/*"))


def test_a_server_that_cannot_start_is_one_line(warm_dir, tmp_path):
    """rollout.server_args the server refuses: the run says the server's own refusal and its log, no traceback."""
    out = tmp_path / "run"
    r = cascade_here("run", f"out={out}", f"model={warm_dir}", *STAGE, "rollout.servers=1",
                     "rollout.server_args=--bogus")
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("note: rollout.servers=")]  # (few cores)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "exited with code 2 while starting: " in r.stderr and "unrecognized arguments: --bogus" in r.stderr
    assert "server-0.log" in r.stderr
    # an --api-key of its own: the server is up but refuses the run's key (reported as a startup timeout, after
    # rollout.startup_timeout_s, before)
    t0 = time.monotonic()
    r = cascade_here("run", f"out={tmp_path / 'run2'}", f"model={warm_dir}", *STAGE, "rollout.servers=1",
                     "rollout.server_args=--api-key other", "rollout.startup_timeout_s=600")
    assert r.returncode == 1 and time.monotonic() - t0 < 300, r.stderr[-2000:]
    assert "refused the run's API key (HTTP 401): set rollout.api_key, not --api-key" in r.stderr


def test_servers_on_another_weights_directory_are_refused_before_training(warm_dir, tmp_path):
    """A run (or ``cascade eval``) whose exchange directory is not the one the servers given by URL read is refused
    in one line; ``cascade eval`` with the servers' directory scores on them what it scores in-process."""
    from cascade.rollout import ServerPool

    other = tmp_path / "ev" / "exchange"
    other.mkdir(parents=True)
    pool = ServerPool(1, warm_dir, other, "k1", 1, tmp_path / "logs")

    def evaluate(*args):
        return subprocess.Popen([sys.executable, "-m", "cascade", "eval", f"model={warm_dir}", *STAGE, *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, CASCADE_API_KEY="k1"))

    def done(p):
        stdout, stderr = p.communicate(timeout=300)
        return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    try:
        out = tmp_path / "run"
        # the two refused at once (each mostly starting up); then cascade eval on the servers' directory (alone: a
        # version it writes there would be the one the others name)
        runs = [cascade(f"out={out}", f"model={warm_dir}", *STAGE, "steps=2", f"rollout.urls=[{pool.urls[0]}]",
                        env={"CASCADE_API_KEY": "k1"}, wait=False),  # the key by environment: past /v1/models
                evaluate(f"rollout.urls=[{pool.urls[0]}]")]
        r, bad = map(done, runs)
        served = done(evaluate(f"rollout.urls=[{pool.urls[0]}]", f"out={tmp_path / 'ev'}"))
    finally:
        pool.close()
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"must serve this run's policy (the same architecture and sizes) with --weights-dir {out / 'exchange'}" \
        in r.stderr and r.stderr.strip().count("\n") == 0
    assert not list((out / "stages").glob("*/checkpoints/*")) and not rl_records(out)
    assert bad.returncode == 2 and "servers given by rollout.urls load it from --weights-dir" in bad.stderr, bad.stderr
    assert served.returncode == 0, served.stderr[-2000:]
    local = done(evaluate())
    assert local.returncode == 0 and json.loads(served.stdout) == json.loads(local.stdout)
