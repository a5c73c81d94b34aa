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
