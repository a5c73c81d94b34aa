"""`make demo`'s promise, checked: the tiny cascade (`cascade run profile=tiny`, every stage at its
configured size, seed 0). The warm-up and behavioral RL raise their held-out avg@4, RLVE's difficulty ends
above its start on at least half of its environments, and the math stage climbs toy/add's ladder (its peak level 2
or more above its start) without its held-out avg@4 falling more than 0.1 (held out from training since 6cd3ff2, its held-out score no longer rises
reliably: +0.03, +0.03, -0.02 on seeds 0-2 there, 0.00, -0.08, +0.04 at 33f0479 (toy/add's level 0->1, 0->0 with a
peak of 2, 0->1), -0.01, -0.05, +0.07 at 3f5064d on another machine (0->1, 0->0 peak 2, 0->1), -0.01, +0.01, -0.05 at
8f05bc7 (aggregation prompts keep the phase's mix; 0->1 peak 3, 0->1 peak 2, 0->0 peak 2), -0.00, -0.07, +0.26 at
613793d (IFEval's keywords and "I.", math/toy answer forms: 0->0 peak 3, 0->0 peak 2, 0->1 peak 2): seed 0 is the one
this test runs; where the level ends moves with the seed, its peak has been 2 or more on every seed since 3f5064d).

The bounds sit below the worst of the seeds measured with this profile (README, "The tiny cascade",
seeds 0/1/2 on 2026-12-05: warm-up +0.89/+0.95/+0.82, math +0.22/+0.06/+0.11, behavior (150 steps)
+0.17/+0.11/+0.22, RLVE rose on 3 of 3 on every seed; on 2026-12-06, with the answer after the thinking judged,
behavior +0.09/+0.20/+0.28 and the rest the same; at cc178f2 (the sampler's float64 running sum, min-p first) math
+0.24/+0.09/+0.11 and behavior +0.21/+0.23/+0.31, the rest the same; at a345f38 (code environments' held-out seeds)
math +0.22/-0.01/+0.14 and behavior +0.29/+0.20/+0.19, the rest the same: seed 1's math stage did not rise; at 2ca2976
(an unclosed think block earns nothing) warm-up +0.82/+0.95/+0.86, math +0.16/-0.01/+0.06, behavior +0.19/+0.25/+0.25,
RLVE 3 of 3; at 6cd3ff2 (training never draws a held-out problem) warm-up +0.87/+0.84/+0.55, math +0.03/+0.03/-0.02
(toy/add's level 0->1, 0->2, 0->1), behavior +0.37/+0.22/+0.21, RLVE 3, 2 and 3 of 3; at 33f0479 (IFEval's answer
judged without the blank lines after the thinking; the warm-up's SFT data changed with it) warm-up +0.86/+0.91/+0.77,
behavior +0.31/+0.24/+0.07, RLVE 3 of 3 on every seed; at 3f5064d (another AMD EPYC; grpo's length bonus after the
normalisation, dynamic sampling's trained groups) warm-up +0.86/+0.77/+0.91, behavior +0.17/+0.20/+0.19, RLVE 3 of 3
on every seed; at 8f05bc7 (aggregation prompts of the drawn problem's own environment) behavior +0.24/+0.25/+0.26, the
rest the same; at 613793d (IFEval's keywords no longer hidden in common words) warm-up +0.88/+0.70/+0.72, behavior
+0.24/+0.22/+0.18, RLVE 3 of 3 on every seed; at 0af2c6d on another machine,
60 behavior steps:
+0.89/+0.86/+0.78, +0.10/+0.15/+0.21, +0.16/+0.10/+0.05), so the test fails when a change stops the recipe
teaching, not when a seed is unlucky (a seed's trajectory differs between machines: with 60 behavior steps
seed 0 rose +0.01 on the later machine, hence the 150). One run of the whole profile: 5.5-7.8 minutes on 2
cores. It starts as soon as these tests are collected (`start_in_background`, called from conftest.py) and runs
on one thread beside the tests before them."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

DEMO = pytest.StashKey[Path]()  # the run's root directory

# below the smallest rise seen over the measured seeds (avg@4)
MIN_GAIN = {"warmup": 0.4, "behavior": 0.05}


def job_root(testrun_uid: str) -> Path:
    """Where a pytest-xdist run's demo lives (the controller starts it, the worker that runs these tests reads it)."""
    return Path(tempfile.gettempdir()) / f"cascade-demo-{testrun_uid}"


def start_in_background(config, root: Path | None = None):
    """Called by conftest.py once this module's tests are selected (by pytest-xdist's controller, for its
    workers): the run starts at once and goes on (one thread) beside the tests collected before these. When it
    ends, its exit status is written to ``root/rc``."""
    root = Path(tempfile.mkdtemp(prefix="cascade-demo-")) if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "stderr.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "cascade", "run", "profile=tiny", f"out={root / 'run'}",
                             "seed=0", "logging.progress=false"], stdout=subprocess.DEVNULL, stderr=log,
                            env=dict(os.environ), cwd=Path(__file__).resolve().parents[1])

    def reap():
        rc = proc.wait()
        log.close()
        (root / "rc.part").write_text(str(rc))
        os.replace(root / "rc.part", root / "rc")

    reaper = threading.Thread(target=reap, daemon=True)
    reaper.start()

    def stop():
        if proc.poll() is None:
            proc.kill()
        reaper.join()
        shutil.rmtree(root, ignore_errors=True)

    config.add_cleanup(stop)
    config.stash[DEMO] = root


@pytest.fixture(scope="module")
def demo_run(request):
    config = request.config
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller started the run
        root = job_root(config.workerinput["testrunuid"])
        assert root.is_dir(), f"no tiny cascade run at {root}: pytest-xdist's controller starts it (tests/conftest.py)"
    else:
        if DEMO not in config.stash:  # e.g. run by node id without the conftest hook's module scan
            start_in_background(config)
        root = config.stash[DEMO]
    deadline = time.monotonic() + 1500
    while not (root / "rc").exists():
        assert time.monotonic() < deadline, "the tiny cascade run took over 25 minutes"
        time.sleep(1)
    stderr = (root / "stderr.log").read_text()
    assert (root / "rc").read_text() == "0", stderr[-3000:]
    out = root / "run"
    states = {}
    for d in sorted((out / "stages").iterdir()):
        st = json.loads((d / "final" / "run_state.json").read_text())
        states[st["stage"]] = st
    return out, states, stderr


@pytest.mark.parametrize("stage", ["warmup", "behavior"])
def test_stage_raises_its_held_out_avg_at_k(demo_run, stage):
    _, states, _ = demo_run
    st = states[stage]
    assert st["eval_k"] == 4
    assert st["accuracy_after"] - st["accuracy_before"] >= MIN_GAIN[stage], st


def test_math_stage_climbs_toy_add_and_keeps_its_held_out_score(demo_run):
    from cascade.run import difficulty_rise

    _, states, _ = demo_run
    st = states["math"]
    rows, _ = difficulty_rise(st)
    start, _, peak = rows["toy/add"]
    assert peak >= start + 2, rows
    # within the noise of 64 held-out problems x 4 samples (seed 1 lost 0.08 at 33f0479; seed 0 lost 0.066 on
    # 2026-12-06 on another machine, the same code as a run that had lost nothing): no more than 0.1 lower
    assert st["accuracy_after"] >= st["accuracy_before"] - 0.1, st


def test_rlve_difficulty_rises_on_at_least_half_of_its_environments(demo_run):
    from cascade.run import difficulty_rise

    _, states, stderr = demo_run
    rows, rose = difficulty_rise(states["rlve"])
    assert len(rows) == 3 and 2 * rose >= len(rows), rows
    assert f"difficulty rose on {rose} of 3" in stderr


def test_report_plots_every_stage(demo_run):
    out, _, _ = demo_run
    r = subprocess.run([sys.executable, "-m", "cascade", "report", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert [s["stage"] for s in info["stages"]] == ["warmup", "rlve", "math", "behavior"]
    assert all(s["accuracy_after"] is not None for s in info["stages"])
    assert (out / "report.png").stat().st_size > 10_000
