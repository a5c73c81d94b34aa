"""The RL loop (through `cascade run`) and `ttc solve` with engine=vllm. Runs in .venv-vllm (pytest -m vllm)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


def _run(*args, timeout=900):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_rl_stage_with_vllm_engine(tmp_path):
    out = tmp_path / "run"
    r = _run("cascade", "run", "stage=rlve", "engine=vllm", f"out={out}", "profile=tiny", "logging.progress=false",
             "steps=3", "checkpoint_every=2")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in recs if x["phase"] == "rl"]
    assert len(rl) == 3
    for x in rl[1:]:  # after each sync the vLLM engine's logprobs match the trainer's
        if "mismatch_max_abs" in x:
            assert x["mismatch_max_abs"] < 1e-3
    assert (out / "stages" / "1-rlve" / "final" / "COMPLETE").exists()


def test_ttc_solve_with_vllm_engine(tmp_path, tiny_dense_dir):
    res = tmp_path / "res.jsonl"
    r = _run("ttc", "solve", "--engine", "vllm", "--model", str(tiny_dense_dir), "--problem", "What is 2+2?",
             "--answer", "4", "--rounds", "1", "--population", "4", "--aggregate", "2", "--budget", "16",
             "--tail", "8", "--seed", "0", "--out", str(res), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in res.read_text().splitlines()]
    assert lines and "mean_accuracy" in json.dumps(lines[-1])


def test_per_prompt_seeds_sample_as_single_requests(tiny_dense_dir):
    from train.engine import SamplingParams, VLLMEngine

    eng = VLLMEngine(str(tiny_dense_dir))
    try:
        prompts = [[5, 6, 7], [8, 9, 10, 11]]
        both = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=6), seeds=[11, 12])
        for i, s in enumerate((11, 12)):
            alone = eng.generate([prompts[i]], SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=s))
            assert [c.token_ids for c in alone] == [c.token_ids for c in both[2 * i:2 * i + 2]]
        with pytest.raises(ValueError, match="seeds"):
            eng.generate(prompts, SamplingParams(), seeds=[1])
    finally:
        eng.close()


def test_the_expert_and_teacher_engines_run_while_the_policys_is_closed(tiny_dense_dir, tmp_path, monkeypatch):
    """engine=vllm in process: an in-process vLLM engine holds its share of the GPU until closed, so the
    teacher's (sft.aggregation.teacher) and the expert's (aggregation.expert) engines run while the
    policy's is closed, and the policy's starts again afterwards: never two engines at once, and the stage
    trains and evaluates on the restarted one."""
    from pathlib import Path

    from cascade.config import RunConfig, SFTStage, StageConfig
    from cascade.stage import StageRunner
    from train.engine import vllm_engine
    from train.optim import OptimConfig
    from train.rl.trainer import RLConfig, SamplingConfig

    live, most, started = set(), [0], []
    init, close = vllm_engine.VLLMEngine.__init__, vllm_engine.VLLMEngine.close

    def spy_init(self, path, *a, **k):
        init(self, path, *a, **k)
        live.add(id(self))
        started.append(str(path))
        most[0] = max(most[0], len(live))

    def spy_close(self):
        live.discard(id(self))
        close(self)

    monkeypatch.setattr(vllm_engine.VLLMEngine, "__init__", spy_init)
    monkeypatch.setattr(vllm_engine.VLLMEngine, "close", spy_close)

    class Recs:
        logged = []

        def log(self, stage, phase, step, m):
            self.logged.append((stage, phase, step, m))

        def begin(self, stage, step):
            pass

    rl_cfg = RLConfig(group_size=2, prompts_per_step=2, sampling=SamplingConfig(max_new_tokens=6), dynamic_sampling=False,
                      length_reward=False, optim=OptimConfig(lr=1e-4))
    st = StageConfig(steps=1, envs={"toy/add": 1.0}, controller="fixed", rl=rl_cfg, eval_problems=2, eval_k=1,
                     sft=SFTStage(steps=1, examples=4, batch_size=2, micro_batch_size=2, max_len=400, difficulties=[0]))
    st.sft.aggregation.teacher, st.sft.aggregation.problems = str(tiny_dense_dir), 2
    st.sft.aggregation.samples, st.sft.aggregation.tails, st.sft.aggregation.fraction = 2, 2, 0.5
    a = st.aggregation
    a.fraction, a.tails, a.tail_tokens, a.expert, a.expert_problems, a.expert_samples = 1.0, 2, 4, str(tiny_dense_dir), 2, 2
    recs = Recs()
    final = StageRunner("s", 0, st, RunConfig(order=[], engine="vllm"), tmp_path, recs, None).run(Path(tiny_dense_dir))
    assert (final / "COMPLETE").exists()
    assert most[0] == 1 and not live, (most, live)  # one engine at a time, all closed at the end
    assert len(started) == 5, started  # the policy's, the expert's, the policy's, the teacher's, the policy's
    assert [m for _, ph, _, m in recs.logged if ph == "expert"] == [{"expert_problems": 2, "expert_pool": 2}]
    assert any(ph == "sft_aggregation" and m.get("aggregation_sft_problems") == 2 for _, ph, _, m in recs.logged)
    assert [ph for _, ph, _, _ in recs.logged].count("rl") == 1
