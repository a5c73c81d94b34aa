"""The stage orchestrator: the four-stage tiny cascade, crash safety, bad configs, records."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cascade.checkpoint import COMPLETE
from tests.conftest import cascade_here

# every stage tiny: a couple of SFT and RL steps (from 256 SFT examples, not the profile's 12,288: preparing those
# took 13 s a run), a checkpoint every step
TINY = ["profile=tiny", "logging.progress=false",
        "stages.warmup.sft.steps=2", "stages.warmup.sft.examples=256", "stages.warmup.steps=2",
        "stages.warmup.pool.size=4", "stages.math.pool.size=4",
        "stages.rlve.steps=2", "stages.math.steps=2", "stages.behavior.steps=2",
        "stages.warmup.checkpoint_every=1", "stages.rlve.checkpoint_every=1", "stages.math.checkpoint_every=1",
        "stages.behavior.checkpoint_every=1",
        # (16 held-out problems a stage, not the profile's 64: the evaluations before and after each stage were about
        # half of this run's time; 16 still reach every family of the math stage's mix)
        *[f"stages.{s}.eval_problems=16" for s in ("warmup", "rlve", "math", "behavior")]]


def cascade(*args, env=None, timeout=900):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "cascade", *args], capture_output=True, text=True, timeout=timeout,
                          env=e)


@pytest.mark.parametrize("args,needle", [
    (["stage=nope"], "unknown stage 'nope'"),
    (["stages.math.rl.group_sz=3"], "'group_sz' is not valid at stages.math.rl; valid keys: activation_checkpointing, advantage"),
    (["stage=math", "rl.group_size=many"], "stages.math.rl.group_size: expected an integer, got 'many'"),
    (["stages.warmup.steps=1.5"], "expected an integer"),
    (["model=/nonexistent/ckpt"], "does not exist"),
    (["profile=huge"], "unknown profile 'huge'"),
    (["stage=math", "rl.loss=nope"], "unknown policy loss 'nope'"),
    (["stage=math", "envs={gym/no_such_env: 1}"], "unknown environment 'gym/no_such_env'"),
    # an empty out= (an unset $OUT) was the current directory, and overwrite=true removed files there
    (["out=", "overwrite=true"], "out= is empty"),
    (["model_preset=nope"], "unknown model preset 'nope'"),  # (refused after out= was written)
    (["stage=math", "order=[rlve]"], "give stage= or order=, not both"),  # (rlve ran, with math's settings unused)
    (["stage=[math,rlve]"], "stage= takes one stage name"),
    (["order=[]"], "order is empty"),
    (["threads=-3"], "threads must be >= 0"),
    (["stage=math", "rl.group_size=1"], "group_size must be >= 2"),  # (every group dropped: nothing trained)
    (["stage=math", "rl.max_prompt_tokens=-5"], "max_prompt_tokens must be >= 0"),  # (every prompt skipped)
    (["stage=math", "rl.micro_batch_size=0"], "micro_batch_size must be >= 1, got micro_batch_size=0"),
    (["stage=math", "rl.loss_cfg.delta=-1"], "loss settings must be > 0, got delta=-1"),
    (["stage=math", "rl.loss_cfg.clip_low=-1"], "loss settings must be >= 0, got clip_low=-1"),
    # negative weights were sampled as shares of a negative total
    (["stage=math", "envs={toy/max: -1, toy/add: -2}"], "stages.math.envs: weights must be finite and >= 0"),
    (["stage=math", "envs={toy/max: .inf, toy/add: 1}"], "stages.math.envs: weights must be finite and >= 0"),
])
def test_bad_configs_fail_before_any_work(tmp_path, args, needle, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.chdir(out)  # (where an empty out= would write)
    (out / "notes.txt").write_text("mine")
    r = cascade_here("run", f"out={out}", *args)  # the entry point's code in this process (tests/conftest.py)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # nothing written, nothing removed


def test_a_stage_that_would_start_from_an_init_model_made_otherwise_is_refused(tmp_path):
    """init-model/ was reused whatever model_preset and seed made it: a rerun with model_preset=tiny-dense
    trained the tiny-moe policy of the first invocation."""
    out = tmp_path / "run"
    (out / "init-model").mkdir(parents=True)
    (out / "init-model" / "COMPLETE").write_text("model_preset=tiny-moe seed=0\n")
    r = cascade_here("run", f"out={out}", "stage=warmup", "model_preset=tiny-dense", "resume=true")
    assert r.returncode == 2 and "made with model_preset=tiny-moe seed=0, not this run's model_preset=tiny-dense" \
        in r.stderr, r.stderr
    assert not (out / "stages").exists()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cascade")
    from train.presets import init_model
    from cascade.reward_model import build_tiny_reward_model

    init_model("tiny-moe", root / "tok-src", seed=0)
    rm = build_tiny_reward_model(root / "rm", root / "tok-src")
    out = root / "run"
    r = cascade("run", f"out={out}", f"stages.behavior.reward_model.path={rm}", "logging.tensorboard=true", *TINY)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def _tensorboard_scalars(out) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(stage, tag) -> [(step, value), ...] as TensorBoard shows them (each stage a run of its own)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    got = {}
    for run in sorted((out / "tensorboard").iterdir()):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            got[run.name, tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    return got


def _check_tensorboard_against_records(out) -> int:
    """Every step's reward_mean/loss in metrics.jsonl (as the run stands) is TensorBoard's one point at that step."""
    from cascade.records import read_records

    tb = _tensorboard_scalars(out)
    checked = 0
    for rec in read_records(out):
        for key in ("reward_mean", "loss", "sft_loss"):
            if isinstance(rec.get(key), (int, float)):
                points = [v for step, v in tb[rec["stage"], f"{rec['phase']}/{key}"] if step == rec["step"]]
                assert points == [pytest.approx(rec[key], rel=1e-6, abs=1e-6)], (rec["stage"], rec["phase"], key,
                                                                               rec["step"], points)
                checked += 1
    return checked


def test_tensorboard_holds_the_same_scalars_as_the_metrics_file(tiny_run):
    out, _ = tiny_run
    assert _check_tensorboard_against_records(out) >= 8
    assert {p.name for p in (out / "tensorboard").iterdir()} == {"warmup", "rlve", "math", "behavior"}


def test_four_stages_each_start_from_the_previous(tiny_run):
    out, r = tiny_run
    names = ["0-warmup", "1-rlve", "2-math", "3-behavior"]
    states = []
    for n in names:
        final = out / "stages" / n / "final"
        assert (final / COMPLETE).exists() and (final / "model.safetensors").exists()
        states.append(json.loads((final / "run_state.json").read_text()))
    assert states[0]["started_from"].endswith("init-model")
    for prev, st in zip(names, states[1:]):
        assert st["started_from"] == str(out / "stages" / prev / "final")
    assert [s["steps"] for s in states] == [4, 2, 2, 2]
    # a checkpoint every step, the newest two kept, none at a stage's last step (final/ is that step)
    for n, st in zip(names, states):
        got = sorted(p.name for p in (out / "stages" / n / "checkpoints").iterdir())
        assert got == [f"step-{k:08d}" for k in range(max(1, st["steps"] - 2), st["steps"])], (n, got)
    # the length reward's run state runs on across stages: one c schedule (tiny: 0.1 -> 1.0 over 100
    # RL steps, a step that trained nothing included) whose position each final/ hands on, never restarted at a
    # stage's start; behavioral RL has none. (The tiny policy may solve nothing, so no step may report c.)
    from train.rl.shaping import LengthRewardConfig

    rl_recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    shaped = [x for x in rl_recs if x["phase"] == "rl" and x["stage"] != "behavior"]  # (its position: the index)
    sched = LengthRewardConfig(coef_start=0.1, coef=1.0, ramp_steps=100)
    assert [x["length_coef"] for x in shaped if "length_coef" in x] == pytest.approx(
        [sched.coef_at(i) for i, x in enumerate(shaped) if "length_coef" in x])
    assert not any("length_coef" in x for x in rl_recs if x["stage"] == "behavior")
    per_stage = [sum(1 for x in shaped if x["stage"] == n[2:]) for n in names]
    handed = [s["length_reward"]["steps"] for s in states]
    assert handed == [sum(per_stage[:i + 1]) for i in range(4)] and per_stage[3] == 0 and handed[2] > 0
    assert "rare_token_top1" in next(x for x in rl_recs if x["phase"] == "rl")
    # stage data: the warm-up's response cap lifts at half its RL steps (tiny: 32 then 40 tokens); the math
    # stage's two phases (tiny: 40 + 40 steps, scaled to the 2 run here) switch after its first RL step; every
    # stage reports held-out avg@k per environment family
    def rl_of(stage):
        return [x for x in rl_recs if x["stage"] == stage and x["phase"] == "rl"]

    assert [x["max_new_tokens"] for x in rl_of("warmup")] == [32, 40]
    assert [x["mix_phase"] for x in rl_of("math")] == [0, 1] and "aggregation_pacore" in rl_of("math")[0]
    assert {(x["stage"]) for x in rl_recs if x["phase"] == "pool"} == {"warmup", "math"}
    assert states[0]["eval_k"] == 4 and set(states[0]["accuracy_after_by_family"]) == {"toy"}
    assert set(states[2]["accuracy_before_by_family"]) == {"toy", "math", "code"}
    # evaluation at each environment's start level; where each difficulty started, ended and peaked
    assert states[1]["eval_difficulty"] is None
    assert set(states[1]["difficulty_start"]) == set(states[1]["difficulty"]) == set(states[1]["difficulty_max"])
    assert all(states[1]["difficulty_max"][e] >= max(states[1]["difficulty"][e], states[1]["difficulty_start"][e])
               for e in states[1]["difficulty"])
    # the hand-off opens in transformers
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "stages" / "3-behavior" / "final")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    phases = {(x["stage"], x["phase"]) for x in recs}
    assert {("warmup", "sft"), ("warmup", "rl"), ("warmup", "pool"), ("rlve", "rl"), ("math", "rl"),
            ("behavior", "rl"), ("behavior", "eval")} <= phases
    assert "held-out avg@4" in r.stderr and "difficulty rose on" in r.stderr
    # rerunning a finished run does no work and ends the same
    again = cascade("run", f"out={out}", *TINY, timeout=300)
    assert again.returncode == 0
    assert json.loads(again.stdout.strip().splitlines()[-1])["final"].endswith("3-behavior/final")


def test_report_writes_a_summary_and_a_plot(tiny_run):
    out, _ = tiny_run
    r = cascade("report", str(out))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    png = Path(info["png"])
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    assert [s["stage"] for s in info["stages"]] == ["warmup", "rlve", "math", "behavior"]
    assert info["stages"][0]["sft_steps"] == 2 and info["stages"][0]["rl_steps"] == 2
    assert "avg@4 before" in " ".join(r.stdout.split())
    empty = out.parent / "empty-run"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    r = cascade("report", str(empty))
    assert r.returncode == 2 and "no step records yet" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_report_names_the_k_of_each_stages_held_out_score(tmp_path, capsys):
    from cascade.report import main

    recs = [{"stage": st, "phase": "rl", "step": 0, "time": i, "reward_mean": 0.5, "accuracy": 0.5} for i, st in
            enumerate(("rlve", "math"))]
    recs += [{"stage": st, "phase": "eval", "step": 0, "time": 5 + i, "accuracy_before": 0.1, "accuracy_after": 0.2,
              "eval_k": k} for i, (st, k) in enumerate((("rlve", 2), ("math", 0)))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main([str(tmp_path)]) == 0
    assert "avg@k (rlve avg@2, math greedy accuracy) before" in " ".join(capsys.readouterr().out.split())
    recs[-1]["eval_k"] = 2
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main([str(tmp_path)]) == 0
    assert "avg@2 before" in " ".join(capsys.readouterr().out.split())


def test_report_max_difficulty_is_the_peak_and_no_held_out_set_scores_nothing(tmp_path):
    """The ZAYA controller lowers difficulty too: the column is the highest level reached, not the last step's;
    a stage run with eval_problems=0 shows no held-out score (not 0.00 -> 0.00)."""
    from cascade.report import summarize

    recs = [{"stage": "math", "phase": "rl", "step": i, "time": 100 + i, "reward_mean": 0.1, "accuracy": 0.1,
             "difficulty": {"math": lvl}} for i, lvl in enumerate([0, 3, 5, 2])]
    recs.append({"stage": "math", "phase": "eval", "step": 4, "time": 200, "accuracy_before": 0.0,
                 "accuracy_after": 0.0, "eval_k": 4, "accuracy_before_by_family": {},
                 "accuracy_after_by_family": {}, "difficulty_start": {"math": 0}, "difficulty_end": {"math": 2},
                 "difficulty_max": {"math": 5}})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (s,) = summarize(tmp_path)
    assert s["difficulty"] == 5.0 and s["difficulty_rose"] == "1/1"
    assert s["accuracy_before"] is None and s["accuracy_after"] is None


def test_report_writes_the_plot_where_it_says(tmp_path, capsys):
    """``--png out`` (no extension): matplotlib wrote out.png while the report named ``out``, a file that did not
    exist; the plot goes to out.png and the report names it."""
    from cascade.report import main

    recs = [{"stage": "math", "phase": "rl", "step": i, "time": i, "reward_mean": 0.5, "accuracy": 0.5} for i in range(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main([str(tmp_path), "--png", str(tmp_path / "plot")]) == 0
    png = Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["png"])
    assert png == tmp_path / "plot.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_report_plots_a_stage_without_rl_steps(tmp_path, monkeypatch):
    """A stage with steps=0 (SFT only) had no line, legend entry nor held-out point in the plot, though the table
    shows it: it takes one x slot, where its held-out score goes from before to after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cascade import report

    recs = [{"stage": "warmup", "phase": "eval", "step": 0, "time": 0, "accuracy_before": 0.0, "eval_k": 4,
             "accuracy_before_by_family": {"toy": 0.0}}]
    recs += [{"stage": "warmup", "phase": "sft", "step": i, "time": 1 + i, "sft_loss": 1.0} for i in range(5)]
    recs += [{"stage": "warmup", "phase": "eval", "step": 5, "time": 9, "accuracy_before": 0.0, "accuracy_after": 0.8,
              "eval_k": 4, "accuracy_before_by_family": {"toy": 0.0}, "accuracy_after_by_family": {"toy": 0.8},
              "difficulty_start": {}, "difficulty_end": {}, "difficulty_max": {}}]
    recs += [{"stage": "math", "phase": "rl", "step": i, "time": 20 + i, "reward_mean": 0.1, "accuracy": 0.1,
              "difficulty": {"toy/add": 0}} for i in range(3)]
    recs += [{"stage": "math", "phase": "eval", "step": 3, "time": 30, "accuracy_before": 0.2, "accuracy_after": 0.3,
              "eval_k": 4, "accuracy_before_by_family": {"toy": 0.2}, "accuracy_after_by_family": {"toy": 0.3}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to read its axes
    report.plot(tmp_path, tmp_path / "r.png")
    axes = figs[0].axes
    held = [list(zip(ln.get_xdata(), ln.get_ydata())) for ln in axes[-1].lines if ln.get_marker() == "o"]
    # warmup at x=0 (its one slot), math's 3 RL steps at x=1..3
    assert held == [[(0, 0.0), (0, 0.8)], [(1, 0.2), (3, 0.3)]]
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["warmup", "math"]
    reward = [ln for ln in axes[0].lines if ln.get_label() == "math"]
    assert list(reward[0].get_xdata()) == [1, 2, 3]
    # each stage one colour in every panel
    colours = [[ln.get_color() for ln in ax.lines if not ln.get_label().startswith("_")] for ax in axes[:3]]
    assert colours[0] == colours[1] == colours[2] and len(set(colours[0])) == 2
    held_colours = [ln.get_color() for ln in axes[-1].lines if ln.get_marker() == "o"]
    assert held_colours == colours[0]


def test_read_records_drops_what_an_abandoned_attempt_logged_past_its_resume_point(tmp_path):
    """Crash after step 7, resumed from the checkpoint at step 5: once step 6 is logged again the dead
    attempt's step 7 (and a stage-end eval it logged) are gone; records of other phases sharing a step stay."""
    from cascade.records import read_records

    recs = [{"stage": "math", "phase": "rl", "step": i, "time": i, "reward_mean": 0.1 * i} for i in range(8)]
    recs += [{"stage": "math", "phase": "eval", "step": 8, "time": 8, "accuracy_after": 0.9},
             {"stage": "math", "phase": "sft_data", "step": 0, "time": 9, "examples": 100},
             {"stage": "math", "phase": "sft_aggregation", "step": 0, "time": 9, "aggregation_sft_problems": 3},
             {"stage": "math", "phase": "rl", "step": 6, "time": 10, "reward_mean": 0.66}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = read_records(tmp_path)
    rl = sorted((r["step"], r["reward_mean"]) for r in got if r["phase"] == "rl")
    assert rl == [(i, 0.1 * i) for i in range(6)] + [(6, 0.66)]
    assert not [r for r in got if r["phase"] == "eval"]
    assert {r["phase"] for r in got} == {"rl", "sft_data", "sft_aggregation"}


def test_a_checkpoint_is_resumed_only_where_its_optimizer_state_lives(tmp_path):
    """Taken in this process, resumed on trainer ranks (or the other way): refused in one line, not resumed
    with a fresh optimizer and schedule."""
    out = tmp_path / "run"
    args = ["run", "stage=rlve", f"out={out}", "profile=tiny", "logging.progress=false", "steps=3",
            "checkpoint_every=1", "eval_problems=2"]
    r = cascade(*args, env={"CASCADE_FAULT": "before_checkpoint:2"})
    assert r.returncode == -signal.SIGKILL
    r = cascade(*args, "trainer.nproc=2")
    assert r.returncode == 2 and "checkpoint step-00000001 was taken by this process" in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") <= 2  # the settings note, the fresh policy's, then the error
    assert "note: stage rlve starts from a fresh tiny-moe policy" in r.stderr and "model=PATH" in r.stderr
    assert cascade(*args).returncode == 0  # resumed where it was taken


def _complete_checkpoints_load(stage_dir: Path):
    from cascade.checkpoint import Checkpointer, load_trainer_state
    from train.model.hf_io import load_pretrained

    ck = Checkpointer(stage_dir / "checkpoints")
    for p in ck.complete():
        load_pretrained(p)
        load_trainer_state(p)
    return [p.name for p in ck.complete()]


def test_pipelined_run_checkpoints_its_buffer_and_resumes(tmp_path):
    """rl.max_staleness=2: a checkpoint holds the rollout groups produced and not yet trained on; a run killed
    after it resumes from it (trainer_state.pt's ``pipeline``) and ends with every step."""
    from cascade.checkpoint import load_trainer_state

    out = tmp_path / "run"
    args = ["run", "stage=warmup", f"out={out}", "profile=tiny", "logging.progress=false", "rl.max_staleness=2",
            "rl.dynamic_sampling=false",
            "stages.warmup.sft.steps=0", "stages.warmup.steps=5", "stages.warmup.checkpoint_every=2"]
    stage = out / "stages" / "0-warmup"
    r = cascade(*args, env={"CASCADE_FAULT": "before_checkpoint:4"})
    assert r.returncode == -signal.SIGKILL
    assert _complete_checkpoints_load(stage) == ["step-00000002"]
    pipe = load_trainer_state(stage / "checkpoints" / "step-00000002")[0]["pipeline"]
    assert pipe["ahead"] >= 1 and len(pipe["pending"]) == pipe["ahead"] and pipe["queue"]
    r = cascade(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((stage / "final" / "run_state.json").read_text())["steps"] == 5


def test_sigkill_mid_stage_and_during_checkpoint_write_then_resume(tmp_path):
    out = tmp_path / "run"
    args = ["run", "stage=warmup", f"out={out}", "profile=tiny", "logging.progress=false",
            "stages.warmup.sft.steps=2", "stages.warmup.sft.examples=256", "stages.warmup.steps=4",
            "stages.warmup.pool.size=4", "stages.warmup.checkpoint_every=1", "rl.dynamic_sampling=false",
            "logging.tensorboard=true"]
    stage = out / "stages" / "0-warmup"
    # 1) killed while writing the checkpoint of step 2: that checkpoint must not count
    r = cascade(*args, env={"CASCADE_FAULT": "checkpoint_write:2"})
    assert r.returncode == -signal.SIGKILL
    assert not (stage / "final").exists()
    assert _complete_checkpoints_load(stage) == ["step-00000001"]
    # 2) resumed, then killed mid-stage (before the checkpoint of step 4)
    r = cascade(*args, env={"CASCADE_FAULT": "before_checkpoint:4"})
    assert r.returncode == -signal.SIGKILL
    done = _complete_checkpoints_load(stage)
    assert done[-1] == "step-00000003"
    with open(out / "metrics.jsonl", "a") as f:  # a record the kill cut short (the next one was glued onto it)
        f.write('{"stage": "warmup", "phase": "rl", "st')
    # 3) resumed to the end: same final step count, nothing corrupt
    r = cascade(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    st = json.loads((stage / "final" / "run_state.json").read_text())
    assert st["steps"] == 6
    assert st["started_from"].endswith("init-model")  # the stage's start, not the checkpoint it resumed from
    _complete_checkpoints_load(stage)
    # final/ has its tokenizer, though two checkpoints were taken after the resume (pruning deleted the checkpoint
    # the run resumed from, and final/ was written from it without tokenizer files: the next stage failed)
    from train.tokenizer import load_tokenizer

    load_tokenizer(stage / "final")
    assert (stage / "checkpoints" / "step-00000003").exists()  # the resumed-from checkpoint is kept
    assert not list((stage / "checkpoints").glob("*.tmp"))
    from cascade.records import read_records

    recs = read_records(out)
    steps = sorted({x["step"] for x in recs if x["phase"] in ("sft", "rl")})
    assert steps == list(range(6))
    # the synchronous loop's rollouts are of the policy's own version, after each resume too (a resumed engine
    # was tagged version 0, so the step after a resume reported a lag of the steps done)
    lags = [x.get("version_lag_max") for x in recs if x["phase"] == "rl"]
    assert len(lags) >= 4 and set(lags) == {0}, lags  # (a step cut by a kill before its checkpoint is run again)
    # TensorBoard shows each step once, the resumed attempt's (the abandoned attempts' later steps purged)
    assert _check_tensorboard_against_records(out) == 2 + 4 * 2  # sft_loss; reward_mean and loss


def test_a_stage_resumed_from_another_start_is_refused_and_a_finished_one_says_so(tmp_path):
    """A stage resumed its own checkpoint whatever this run handed it (``stage=rlve`` alone, killed, then the whole
    cascade: rlve went on from the fresh model while its final/ said it started from the warm-up's)."""
    from train.presets import init_model

    a, b = tmp_path / "a", tmp_path / "b"
    init_model("tiny-moe", a, seed=0)
    init_model("tiny-moe", b, seed=1)
    out = tmp_path / "run"
    args = ["run", "stage=warmup", f"out={out}", "profile=tiny", "logging.progress=false", "stages.warmup.sft.steps=0",
            "stages.warmup.steps=3", "stages.warmup.pool.size=4", "stages.warmup.checkpoint_every=1"]
    r = cascade(*args, f"model={a}", env={"CASCADE_FAULT": "before_checkpoint:2"})
    assert r.returncode == -signal.SIGKILL
    r = cascade(*args, f"model={b}")
    assert r.returncode == 2 and f"continue a stage started from {a}" in r.stderr, r.stderr[-2000:]
    r = cascade(*args, f"model={a}")
    assert r.returncode == 0, r.stderr[-2000:]
    final = out / "stages" / "0-warmup" / "final"
    assert json.loads((final / "run_state.json").read_text())["started_from"] == str(a)
    r = cascade(*args, f"model={b}")
    assert r.returncode == 0 and "finished, started from" in r.stderr and "keeps what it ran" in r.stderr


def test_a_pool_with_nothing_in_range_says_so_and_a_stage_rl_seed_counts(tmp_path):
    """No pool problem within the pass-rate range: the whole pool is trained on, which the record showed as every
    problem kept (pool_kept == pool_size) and nothing said; a stage's ``rl.seed`` was printed but overwritten."""
    from cascade.records import read_records

    runs = {}
    for seed in (0, 12345):
        out = tmp_path / f"run{seed}"
        r = cascade("run", "stage=warmup", f"out={out}", "profile=tiny", "logging.progress=false",
                    "stages.warmup.sft.steps=0", "stages.warmup.steps=1", "stages.warmup.pool.size=4",
                    "stages.warmup.pool.min_pass_rate=0.9", "stages.warmup.pool.max_pass_rate=1.0",
                    f"stages.warmup.rl.seed={seed}")
        assert r.returncode == 0, r.stderr[-2000:]
        runs[seed] = read_records(out)
    pool = next(x for x in runs[0] if x["phase"] == "pool")
    assert pool["pool_fallback"] is True and pool["pool_in_range"] == 0 and pool["pool_kept"] == pool["pool_size"]
    assert "no pool problem's pass rate is within [0.9, 1.0]" in r.stderr
    rl = {s: [x for x in recs if x["phase"] == "rl"][0] for s, recs in runs.items()}
    keys = ("response_len", "truncated_frac", "rare_token_top10")  # what the sampling seed decides
    assert [rl[0].get(k) for k in keys] != [rl[12345].get(k) for k in keys]


def test_an_order_unlike_the_configured_one_hands_each_stage_the_one_before(tmp_path):
    """``order=[behavior, rlve]``: rlve started from a fresh policy (the configured index looked for a finished
    stage before rlve's, and behavior's comes after it), with a note saying no earlier stage finished."""
    cfg = tmp_path / "order.yaml"
    small = "{steps: 1, eval_problems: 2, eval_k: 1, rl: {group_size: 2, prompts_per_step: 2, sampling: {max_new_tokens: 8}}}"
    cfg.write_text(f"order: [behavior, rlve]\nstages:\n  behavior: {small}\n  rlve: {small}\n")
    out = tmp_path / "run"
    r = cascade("run", "profile=tiny", f"config={cfg}", f"out={out}", "logging.progress=false", "threads=1")
    assert r.returncode == 0, r.stderr[-2000:]
    state = json.loads((out / "stages" / "1-rlve" / "final" / "run_state.json").read_text())
    assert state["started_from"] == str(out / "stages" / "3-behavior" / "final")
    assert "stage rlve starts from a fresh" not in r.stdout + r.stderr  # (behavior, first, does)
