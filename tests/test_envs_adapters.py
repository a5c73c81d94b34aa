"""The RLVE-Gym (``rlve/``) and reasoning-core (``rc/``) adapters, and the generation time bound of
``cascade envs check`` (a slow generator is capped below the level where it exceeds the bound)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from envs import Environment, Problem, Score, get_env, list_envs, register, rlve_adapter
from envs.caps import bound_generate, load_caps
from envs.check import check_ids, match_pattern, update_caps
from envs.cli import main as envs_main

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# A sample of RLVE-Gym's environments (the full set is `cascade envs check 'rlve/*'`)
RLVE_SAMPLE = ["AdditionTable", "Multiplication", "SumGCD", "CycleCounting", "BezoutIdentity", "TwoSAT"]
RC_SAMPLE = ["arithmetics", "graph_pathfinding", "set_missing_element", "logic_qa"]
GARBAGE = ["", "   ", "<answer>", "</answer><answer>", "<answer>\x00\ud800</answer>", "\\boxed{", "\\boxed{}}",
           "<answer>" + "9" * 5000 + "</answer>", "<think><answer>1</answer>", "<answer>-1e999 nan inf</answer>",
           "<answer>[[[[</answer>", "\\boxed{\\boxed{1}}", "Assistant: <answer>0</answer>", "x" * 50_000]


# -- the generation time bound ---------------------------------------------------------------------
# The bounds count CPU time: a slow generator here computes (a sleeping one would run into the wall-time backstop
# only). The threads a run-time bound abandons stop when the test ends; a check's worker is killed.
_STOP = threading.Event()


@pytest.fixture(autouse=True)
def _stop_abandoned_generators():
    _STOP.clear()
    yield
    _STOP.set()


def _compute(seconds: float = 30.0) -> None:
    """Keep a core busy in this thread for ``seconds`` of its CPU time (or until the test ends)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds and not _STOP.is_set():
        pass


@register("test/slow_gen")
class _SlowGen(Environment):
    """Instant up to difficulty 1; its generator computes far past any bound from difficulty 2."""

    generate_time_limit = 0.5

    def generate(self, seed, difficulty):
        if difficulty >= 2:
            _compute()
        return self.problem(f"say {seed % 7}", str(seed % 7), seed, difficulty)

    def check(self, problem, response):
        ok = self.extract(response) == problem.answer
        return Score(float(ok), ok, True)


def test_slow_generator_is_capped_below_the_level_it_exceeds(tmp_path):
    t = time.perf_counter()
    results = list(check_ids(["test/slow_gen", "toy/add"], [0, 1, 2, 3], [0, 1], jobs=2, gen_limit=0.5))
    assert time.perf_counter() - t < 60
    by_id = {r.env_id: r for r in results}
    slow = by_id["test/slow_gen"]
    assert slow.failures == [] and slow.cap == 1 and "difficulty=2" in slow.cap_reason
    assert by_id["toy/add"].cap is None and by_id["toy/add"].failures == []
    caps_file = tmp_path / "caps.json"
    caps = update_caps(results, [0, 1, 2, 3], caps_file)
    assert caps == {"test/slow_gen": {"max_difficulty": 1, "reason": slow.cap_reason}}
    assert load_caps(caps_file)["test/slow_gen"]["max_difficulty"] == 1
    # the registry reads the recorded cap
    old = os.environ.get("CASCADE_DIFFICULTY_CAPS")
    os.environ["CASCADE_DIFFICULTY_CAPS"] = str(caps_file)
    try:
        assert get_env("test/slow_gen").max_difficulty == 1
        assert get_env("toy/add").max_difficulty == type(get_env("toy/add")).max_difficulty  # no cap
    finally:
        if old is None:
            del os.environ["CASCADE_DIFFICULTY_CAPS"]
        else:
            os.environ["CASCADE_DIFFICULTY_CAPS"] = old
    # a later check that no longer needs the cap drops it
    from envs.check import CheckResult

    assert update_caps([CheckResult("test/slow_gen", [], 0.1)], [0, 1, 2, 3], caps_file) == {}


def test_a_check_of_higher_difficulties_only_never_raises_a_recorded_cap(tmp_path):
    """A time-out at difficulty d caps at d - 1, which replaced any recorded cap: `cascade envs check rg/jugs
    --difficulties 4` raised jugs' cap from 1 (difficulty 2 had timed out) to 3, with 2 and 3 never checked. A cap is
    raised only where the check covered every difficulty from the recorded cap + 1 up to the new one, and dropped
    only where it covered every difficulty above it."""
    from envs.check import CheckResult

    caps_file = tmp_path / "caps.json"
    caps_file.write_text(json.dumps({"x/slow": {"max_difficulty": 1, "reason": "difficulty=2 took over 10s"}}))

    def timed_out_at(d, lowest):
        return CheckResult("x/slow", [f"x/slow d={d} seed=0: ... at the lowest difficulty checked"] if lowest else [],
                           10.0, {}, d - 1, f"generate(seed=0, difficulty={d}) took over 10s")
    for diffs, d in (([4], 4), ([3, 4, 5], 3), ([0, 1, 2, 4], 4), ([2, 4], 4)):
        got = update_caps([timed_out_at(d, lowest=d == min(diffs))], diffs, caps_file, write=False)
        assert got["x/slow"] == {"max_difficulty": 1, "reason": "difficulty=2 took over 10s"}, diffs
    assert update_caps([timed_out_at(1, True)], [1, 2], caps_file, write=False)["x/slow"]["max_difficulty"] == 0
    for diffs in ([0, 1, 2, 3, 4], [2, 3, 4]):  # 2 and 3 generate in time now: raised
        got = update_caps([timed_out_at(4, False)], diffs, caps_file, write=False)["x/slow"]
        assert got == {"max_difficulty": 3, "reason": "generate(seed=0, difficulty=4) took over 10s"}, diffs
    in_time = CheckResult("x/slow", [], 1.0, {}, None, "")
    for diffs in ([5], [0, 1, 2, 4, 5]):  # a check that skipped a level above the cap does not drop it
        assert update_caps([in_time], diffs, caps_file, write=False)["x/slow"]["max_difficulty"] == 1, diffs
    assert "x/slow" not in update_caps([in_time], [2, 3, 4, 5], caps_file, write=False)
    for diffs in ([0, 1], [1]):  # nothing above the cap checked: it stays (an empty range dropped it once)
        assert update_caps([in_time], diffs, caps_file, write=False)["x/slow"]["max_difficulty"] == 1, diffs
    caps_file.unlink()
    assert update_caps([timed_out_at(4, True)], [4], caps_file, write=False)["x/slow"]["max_difficulty"] == 3


def test_cli_check_records_the_cap(tmp_path, capsys):
    caps_file = tmp_path / "caps.json"
    assert envs_main(["check", "test/slow_gen", "--difficulties", "0-2", "--seeds", "1",
                      "--gen-limit", "0.5", "--caps", str(caps_file)]) == 0
    out = capsys.readouterr().out
    assert "capped at difficulty 1" in out and "slowest 1 environments" in out
    assert json.loads(caps_file.read_text())["test/slow_gen"]["max_difficulty"] == 1


class _SlowGenFrom(_SlowGen):
    """Slow from difficulty ``slow_from`` (2 by default)."""

    def __init__(self, slow_from: int = 2):
        self.slow_from = int(slow_from)

    def generate(self, seed, difficulty):
        return super().generate(seed, 2 if difficulty >= self.slow_from else 0)


def test_cli_check_does_not_record_caps_measured_with_constructor_arguments(tmp_path, capsys):
    """A cap measured on an environment built with --arg is not the id's (get_env builds it with the
    defaults): not recorded, and said so."""
    from envs import base

    caps_file = tmp_path / "caps.json"
    register("test/slow_gen_from")(_SlowGenFrom)
    try:
        assert envs_main(["check", "test/slow_gen_from", "--difficulties", "0-1", "--seeds", "1", "--gen-limit", "0.5",
                          "--arg", "slow_from=1", "--caps", str(caps_file)]) == 0
    finally:
        base._REGISTRY.pop("test/slow_gen_from", None)
    out = capsys.readouterr().out
    assert "capped at difficulty 0" in out and "caps not recorded: measured with constructor arguments" in out
    assert not caps_file.exists()


def test_cli_check_refuses_a_gen_limit_that_is_not_positive(tmp_path):
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match="--gen-limit must be > 0 seconds"):
            envs_main(["check", "toy/add", "--gen-limit", bad, "--caps", str(tmp_path / "caps.json")])


def test_run_time_bound_falls_back_to_a_lower_level():
    env = _SlowGen()
    bound_generate(env, 0.3)
    t = time.perf_counter()
    p = env.generate(5, 3)
    assert time.perf_counter() - t < 3  # waited once at 3 and once at 2, not 30 s
    assert p.difficulty == 1 and env.max_difficulty == 1
    t = time.perf_counter()
    assert env.generate(6, 4).difficulty == 1 and time.perf_counter() - t < 0.3  # the cap holds


class _SlowSeed(_SlowGen):
    """Slow at every level for seed 5 only."""

    def generate(self, seed, difficulty):
        if seed == 5:
            _compute()
        return self.problem(f"say {seed % 7}", str(seed % 7), seed, difficulty)


class _Waits(_SlowGen):
    """Takes ``wall`` seconds at every level while computing ``cpu`` seconds of them; from level ``from_level`` on, it
    also waits for ``wait`` (an Event) to be set."""

    def __init__(self, wall: float = 0.0, cpu: float = 0.0, wait: threading.Event | None = None, from_level: int = 0):
        self.wall, self.cpu, self.wait, self.from_level = wall, cpu, wait, from_level

    def generate(self, seed, difficulty):
        t0 = time.perf_counter()
        _compute(self.cpu)
        if self.wait is not None and difficulty >= self.from_level:
            self.wait.wait(60)
        time.sleep(max(0.0, self.wall - (time.perf_counter() - t0)))
        return self.problem(f"say {seed % 7}", str(seed % 7), seed, difficulty)


def test_run_time_bound_counts_the_generators_cpu_time_not_the_machines_load():
    """A generate that takes longer than the bound in wall time while computing less than it (waiting, or sharing
    the interpreter with busy threads: a loaded machine) gives the problem asked for. A wall-time bound gave a lower
    level here, so the problem of a (seed, difficulty) depended on the machine's load."""
    env = _Waits(wall=1.0, cpu=0.05)
    bound_generate(env, 0.3)
    p = env.generate(5, 3)
    assert (p.seed, p.difficulty, env.max_difficulty) == (5, 3, None)
    # three busy threads take most of the interpreter: 0.2 s of CPU takes well over the 0.3 s bound in wall time
    busy = [threading.Thread(target=_compute, args=(30.0,), daemon=True) for _ in range(3)]
    for t in busy:
        t.start()
    env = _Waits(cpu=0.2)
    bound_generate(env, 0.3)
    t = time.perf_counter()
    p = env.generate(6, 2)
    assert time.perf_counter() - t > 0.3  # (the load did slow it past the bound)
    assert (p.seed, p.difficulty, env.max_difficulty) == (6, 2, None)
    _STOP.set()
    for t in busy:
        t.join(5)


class _WaitsOverTheBound(_Waits):
    def __init__(self):
        super().__init__(wall=0.6)


def test_check_counts_the_workers_cpu_time_not_the_machines_load():
    """`cascade envs check` bounds a generate by its worker's CPU time too: a generator that takes 0.6 s doing
    nothing passes a 0.3 s bound (a wall-time bound capped it at its lowest level)."""
    from envs.caps import process_cpu_seconds

    (r,) = check_ids([f"{__name__}:_WaitsOverTheBound"], [0, 1], [0], jobs=1, gen_limit=0.3)
    assert (r.failures, r.cap) == ([], None) and r.stats["gen_max_s"] >= 0.6
    _compute(0.2)
    assert abs(process_cpu_seconds(os.getpid()) - sum(os.times()[:4])) < 0.05  # the clock the check reads
    assert process_cpu_seconds(2 ** 22 + 1) is None  # (past pid_max: no such process)


class _RunsPrograms(_SlowGen):
    """From difficulty 1, generating runs four programs of 0.3 s of CPU each, one after the other."""

    def generate(self, seed, difficulty):
        for _ in range(4 if difficulty >= 1 else 0):
            subprocess.run([PY, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"],
                           check=True)
        return self.problem(f"say {seed % 7}", str(seed % 7), seed, difficulty)


def test_check_counts_the_cpu_time_of_the_programs_a_generator_runs():
    """The worker's CPU time includes the children it ran (1.2 s of programs over a 0.5 s bound: capped below
    difficulty 1 long before the wall-time backstop)."""
    t = time.perf_counter()
    (r,) = check_ids([f"{__name__}:_RunsPrograms"], [0, 1], [0], jobs=1, gen_limit=0.5)
    assert r.cap == 0 and "difficulty=1" in r.cap_reason and r.failures == []
    assert time.perf_counter() - t < 5.0  # (the backstop: 10 x 0.5 s)


def test_run_time_bound_abandons_a_generator_that_waits_past_its_wall_time_backstop():
    """Not computing does not make a generator wait forever: past WALL_BACKSTOP times the bound in wall time the
    level below is used, as for a generator over its CPU time."""
    from envs.caps import WALL_BACKSTOP

    release = threading.Event()
    env = _Waits(wait=release, from_level=2)
    bound_generate(env, 0.1)
    t = time.perf_counter()
    p = env.generate(5, 2)
    took = time.perf_counter() - t
    release.set()
    assert (p.seed, p.difficulty, env.max_difficulty) == (5, 1, 1)
    assert 0.1 * WALL_BACKSTOP <= took < 0.1 * WALL_BACKSTOP + 2


def test_run_time_bound_draws_another_seed_at_the_easiest_level():
    env = _SlowSeed()
    bound_generate(env, 0.3)
    t = time.perf_counter()
    p = env.generate(5, 0)
    assert time.perf_counter() - t < 2 and p.seed != 5 and p.difficulty == 0
    assert env.verify(p, env.reference_response(p)).correct  # the problem carries the seed it came from


class _SlowPrepare(_SlowGen):
    """A slow one-time load (as reasoning-core's task imports) and a fast generator at every level."""

    def __init__(self):
        self.prepared = 0

    def prepare(self):
        if not self.prepared:
            time.sleep(1.0)
        self.prepared += 1

    def generate(self, seed, difficulty):
        assert self.prepared, "generate before prepare"
        return self.problem(f"say {seed % 7}", str(seed % 7), seed, difficulty)


def test_one_time_preparation_is_not_taken_for_a_slow_generator():
    env = _SlowPrepare()
    bound_generate(env, 0.3)
    p = env.generate(5, 3)  # the 1 s load exceeds the bound, but runs before its clock
    assert (p.seed, p.difficulty, env.max_difficulty) == (5, 3, None)
    results = list(check_ids([f"{__name__}:_SlowPrepare"], [0, 3], [0], jobs=1, gen_limit=0.3))
    assert results[0].failures == [] and results[0].cap is None
    assert results[0].stats["gen_max_s"] < 0.3 <= results[0].seconds


def test_get_env_bounds_adapter_generators():
    env = get_env("test/slow_gen")
    assert getattr(env.generate, "__wrapped__", None) is not None  # the run-time bound is in place
    assert env.generate(1, 0).prompt.startswith("say")


def test_alternative_patterns_use_the_first_that_matches(capsys):
    known = ["gym/a", "gym/b", "rlve/X"]
    assert match_pattern("rlve/*|gym/*", known) == ["rlve/X"]
    assert match_pattern("nothere/*|gym/*", known) == ["gym/a", "gym/b"]
    assert "using 'gym/*'" in capsys.readouterr().err
    assert match_pattern("nothere/*|none/*", known) == []


def test_listing_imports_no_torch_nor_the_adapted_packages():
    list_envs()  # the catalogue caches exist
    code = ("import sys; from envs import list_envs; ids = list_envs(); "
            "print(sum(i.startswith('rlve/') for i in ids), sum(i.startswith('rc/') for i in ids), "
            "[m for m in ('torch', 'Gym', 'reasoning_core') if m in sys.modules])")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    n_rlve, n_rc, mods = out.stdout.strip().split(" ", 2)
    assert mods == "[]"
    from envs import reasoning_core_adapter, rlve_adapter

    assert int(n_rlve) == len(rlve_adapter.catalog()) - len(rlve_adapter.EXCLUDED) * rlve_adapter.available()
    assert int(n_rc) == len(reasoning_core_adapter.catalog()) - \
        len(reasoning_core_adapter.EXCLUDED) * reasoning_core_adapter.available()


# -- RLVE-Gym ---------------------------------------------------------------------------------------
def _rlve():
    return pytest.importorskip("Gym.environments"), pytest.importorskip("Gym.parameter_controllers")


def test_cli_lists_the_rlve_environments(capsys):
    gym_envs, _ = _rlve()
    assert envs_main(["list", "rlve/*", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    from envs.rlve_adapter import EXCLUDED

    assert {r["id"] for r in rows} == {f"rlve/{n}" for n in gym_envs.identifier2environment} - \
        {f"rlve/{n}" for n in EXCLUDED}
    assert len(rows) >= 390 and all(r["family"] == "rlve" for r in rows)


@pytest.mark.parametrize("name", RLVE_SAMPLE[:4])
def test_rlve_difficulty_follows_rlves_controller(name):
    _, controllers = _rlve()
    env = get_env(f"rlve/{name}")
    ctrl = controllers.identifier2controller[name]()
    for d in range(4):
        own = ctrl.get_parameter_list()
        assert env.parameter_list(d) == own
        for seed in range(3):
            p = env.generate(seed, d)
            assert p.meta["parameter"] in json.loads(json.dumps(own)), (d, p.meta["parameter"], own)
        ctrl.update()
    if name == "AdditionTable":  # N = 3 at level 0, one more per controller step
        assert [env.generate(0, d).meta["parameter"]["N"] for d in range(4)] == [3, 4, 5, 6]


@pytest.mark.parametrize("name", RLVE_SAMPLE)
def test_rlve_scorer_agrees_on_reference_and_wrong_answers(name):
    gym_envs, _ = _rlve()
    env = get_env(f"rlve/{name}")
    for d, seed in ((0, 0), (2, 1), (3, 7)):
        p = env.generate(seed, d)
        assert p.prompt.endswith("Give your final answer between <answer> and </answer>.")
        assert p.to_dict() == env.generate(seed, d).to_dict()
        json.dumps(p.to_dict())
        # RLVE's own generator, given the seed and parameter, poses the same problem
        own = gym_envs.identifier2environment[name]()
        assert own.generator(seed=p.meta["rlve_seed"], parameter=p.meta["parameter"])
        assert p.prompt.startswith(own.prompt_generator())
        ref = env.reference_response(p)
        s = env.verify(p, "<think>let me see</think>" + ref)
        assert s.correct and s.reward == own.verifier(f"<answer>{p.answer}</answer>")["reward"] >= 0.999
        assert env.verify(p, f"\\boxed{{{p.answer}}}").correct  # the chat-template marker too
        wrong = env.verify(p, "<answer>qx9 ### zz</answer>")
        assert not wrong.correct and wrong.reward == own.verifier("<answer>qx9 ### zz</answer>")["reward"] < 1
        assert env.verify(p, "I don't know.").reward == own.verifier("I don't know.")["reward"]
        for g in GARBAGE:
            s = env.verify(p, g)
            assert isinstance(s, Score) and -1.0 <= s.reward <= 1.0
        # a problem that went through JSON (another process) still verifies
        q = Problem.from_dict(json.loads(json.dumps(p.to_dict())))
        assert env.verify(q, ref).correct


def test_rlve_generation_leaves_the_callers_random_state_alone():
    import random

    import numpy as np

    _rlve()
    env = get_env("rlve/Multiplication")
    random.seed(123)
    np.random.seed(123)
    a, b = random.random(), np.random.rand()
    random.seed(123)
    np.random.seed(123)
    env.generate(11, 2)
    assert (random.random(), np.random.rand()) == (a, b)


# -- reasoning-core ---------------------------------------------------------------------------------
def _rc():
    return pytest.importorskip("reasoning_core")


@pytest.mark.timeout(300)
def test_rc_and_rg_problems_are_the_same_in_every_process_for_any_seed():
    """A problem is a function of (seed, difficulty) in any process: reasoning-core tasks drew on OS entropy
    (gramforge's random.seed(None), random.Random(), np.random.default_rng(), Faker's shared generator), and
    rg/pool_matrix failed on every 62-bit seed the curriculum draws (numpy takes 32-bit seeds)."""
    _rc()
    pytest.importorskip("reasoning_gym")
    code = ("import hashlib, random, warnings; warnings.simplefilter('ignore'); from envs import get_env; "
            "big = random.Random(0).getrandbits(62); "
            "print([hashlib.md5(get_env(n).generate(s, d).prompt.encode()).hexdigest()[:8] for n in "
            "('rc/arithmetics', 'rc/regex_following', 'rc/lambda_reduction', 'rc/table_qa', "
            "'rc/qualitative_causal_reasoning', 'rg/pool_matrix') for s, d in ((11, 1), (big, 2))])")
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(ROOT))
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=240) for _ in range(2)]
    for r in outs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout, [r.stdout for r in outs]


@pytest.mark.parametrize("name", RC_SAMPLE)
def test_rc_scorer_agrees_on_reference_and_wrong_answers(name):
    rc = _rc()
    from reasoning_core.template import Entry

    env = get_env(f"rc/{name}")
    assert env.family == "rc"
    for d, seed in ((0, 0), (2, 3)):
        p = env.generate(seed, d)
        assert p.to_dict() == env.generate(seed, d).to_dict()
        assert p.meta["level"] == d and p.meta["rc_metadata"]["_level"] == d  # reasoning-core's own level
        assert p.prompt.endswith("Put your final answer within \\boxed{}.")
        entry = Entry(metadata=p.meta["rc_metadata"], answer=p.answer)
        assert rc.get_score_answer_fn(name)(p.answer, entry) == 1  # reasoning-core's own scorer
        ref = env.reference_response(p)
        s = env.verify(p, ref)
        assert s.correct and s.reward == 1.0
        assert env.verify(p, f"<answer>{p.answer}</answer>").correct
        q = Problem.from_dict(json.loads(json.dumps(p.to_dict())))
        assert env.verify(q, ref).correct
        for bad in ("<answer>qx9 ### zz</answer>", "\\boxed{-98765.4321}"):
            s = env.verify(p, bad)
            assert not s.correct and s.reward == float(rc.get_score_answer_fn(name)(env.extract(bad), entry)) < 1
        s = env.verify(p, "I don't know.")
        assert not s.correct and s.reward == 0.0 and not s.format_ok
        for g in GARBAGE:
            s = env.verify(p, g)
            assert isinstance(s, Score) and 0.0 <= s.reward <= 1.0


def test_rc_difficulty_is_reasoning_cores_level():
    _rc()
    env = get_env("rc/arithmetics")
    cfgs = [env.generate(0, d).meta["rc_metadata"]["_config"] for d in (0, 3)]
    assert cfgs[0]["level"] == 0 and cfgs[1]["level"] == 3 and cfgs[0] != cfgs[1]
    from reasoning_core import get_task

    task = get_task("arithmetics")
    task.config.set_level(3)
    assert {k: v for k, v in task.config.to_dict().items() if k != "seed"} == \
        {k: v for k, v in cfgs[1].items() if k != "seed"}


def test_rc_excluded_tasks_are_named_with_reasons():
    _rc()
    from envs.reasoning_core_adapter import EXCLUDED

    ids = set(list_envs())
    for name, why in EXCLUDED.items():
        assert f"rc/{name}" not in ids and why


def test_tiny_rlve_stage_runs_on_the_rlve_gym_environments(tmp_path):
    """`cascade run stage=rlve profile=tiny` with the recipe's `rlve/*|gym/*` choice takes RLVE-Gym's
    environments when the package is installed, says so, and trains two steps on them."""
    pytest.importorskip("Gym")
    out = tmp_path / "run"
    r = subprocess.run([PY, "-m", "cascade", "run", "stage=rlve", "profile=tiny", f"out={out}", "steps=2",
                        'envs={"rlve/*|gym/*": 1}', "logging.progress=false", "eval_problems=8"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "using 'rlve/*'" in r.stdout + r.stderr
    state = json.loads((out / "stages" / "1-rlve" / "final" / "run_state.json").read_text())
    assert state["steps"] == 2
    assert len(state["difficulty"]) > 300 and all(k.startswith("rlve/") for k in state["difficulty"])


def _rg_wrong(name, d, wrong, want=lambda p: True):
    """(gold verdict, wrong verdict) on the first problem of ``rg/name`` at level ``d`` that ``want`` accepts."""
    env = get_env(f"rg/{name}")
    for seed in range(60):
        p = env.generate(seed, min(d, env.max_difficulty))
        bad = wrong(str(p.answer), p)
        if want(p) and bad is not None and bad != str(p.answer):
            return env.verify(p, f"<answer>{p.answer}</answer>").correct, env.verify(p, f"<answer>{bad}</answer>")
    raise AssertionError(f"no rg/{name} problem to try")


@pytest.mark.parametrize("name,d,wrong,want", [
    ("gsm_symbolic", 0, lambda g, p: "-" + g, None),
    ("gsm_symbolic", 0, lambda g, p: g + " or 7", None),
    ("number_sorting", 2, lambda g, p: json.dumps([str(round(float(x))) for x in json.loads(g.replace("'", '"'))]), None),
    ("figlet_font", 9, lambda g, p: g[:10] + "X" * (len(g) - 10) if len(g) > 10 else None, None),
    ("word_sorting", 0, lambda g, p: g + ", zebra", None),
    ("letter_jumble", 0, lambda g, p: g + " banana", None),
    ("spell_backward", 9, lambda g, p: g + "q", None),
    ("advanced_geometry", 0, lambda g, p: g + ", (1, 2)", lambda p: p.prompt.lower().count("orthocenter")),
    ("time_intervals", 0, lambda g, p: "-" + g, lambda p: p.answer.startswith("00:")),
    ("puzzle24", 1, lambda g, p: "6 + 6 + 6 + 6", lambda p: "6, 6, 6, 6" not in p.prompt),
    ("puzzle24", 0, lambda g, p: "4*3*2*1", None),
])
def test_rg_answers_its_scorer_credits_wrongly_are_not_correct(name, d, wrong, want):
    """reasoning-gym scorers that gave full credit to wrong answers on most problems (a reward hack): a dropped
    minus sign, numbers within 1, any 10 letters in place, words appended, an expression of other numbers."""
    pytest.importorskip("reasoning_gym")
    gold, bad = _rg_wrong(name, d, wrong, want or (lambda p: True))
    assert gold and not bad.correct and bad.reward == 0.0, bad


def test_rg_levels_one_constant_answer_solves_are_not_used():
    """game_of_life from level 1: the all-zero grid on every problem; rotten_oranges from level 2: -1 on 85-100%;
    syllogism: Yes on 93% at level 0, ~70% above; shortest_path: infeasible on 48-70%; gcd from level 2: 1 on 76-87%."""
    pytest.importorskip("reasoning_gym")
    assert get_env("rg/game_of_life").max_difficulty == 0 and get_env("rg/rotten_oranges").max_difficulty == 1
    assert get_env("rg/gcd").max_difficulty == 1  # (1 was the gcd of 76-87% of the problems from level 2)
    for name, constant in (("syllogism", "yes"), ("shortest_path", "infeasible"), ("gcd", "1")):
        e = get_env(f"rg/{name}")
        for d in range(e.max_difficulty + 1):
            assert sum(str(e.generate(s, d).answer).strip().lower() == constant for s in range(100)) <= 60, (name, d)


def test_numpy_draws_inside_a_generation_are_the_threads_own():
    """A generation abandoned by the time bound went on drawing from numpy's global stream, which the next
    generation had seeded (and restored its saved state when it ended): the same seed then made another problem
    (5-30 of 30 rc/table_qa problems). Inside a generation the adapted packages' np.random is the thread's own
    RandomState: the stream np.random.seed(seed) gives, whatever the global one does meanwhile."""
    import numpy as np

    from envs.rlve_adapter import _NUMPY_RANDOM, _seeded

    with _seeded(5):
        alone = _NUMPY_RANDOM.randint(0, 10**9, 6).tolist()
    with _seeded(5):
        np.random.seed(123)  # (another thread's generation seeding the global stream meanwhile)
        np.random.randint(0, 10, 50)
        disturbed = _NUMPY_RANDOM.randint(0, 10**9, 6).tolist()
    assert alone == disturbed == np.random.RandomState(5).randint(0, 10**9, 6).tolist()
    assert _NUMPY_RANDOM.randint is np.random.randint  # outside a generation: numpy's own


def test_functions_bound_to_the_global_random_draw_the_seeded_stream_and_the_callers_state_comes_back():
    """Code that took ``random``'s functions by name (``from random import randint``: bound to the global generator,
    out of the per-thread proxy's reach) and numpy's legacy global functions still draw the stream of the
    generation's seed inside ``_seeded``; afterwards both global states are the caller's again."""
    import numpy as np

    from envs.rlve_adapter import _seeded
    from random import randint

    random.seed(77)
    np.random.seed(77)
    py_before, np_before = random.getstate(), np.random.get_state()
    with _seeded(5):
        drawn = [randint(0, 10**9) for _ in range(4)]
        np_drawn = np.random.randint(0, 10**9, 4).tolist()
    ref = random.Random(5)
    assert drawn == [ref.randint(0, 10**9) for _ in range(4)]
    assert np_drawn == np.random.RandomState(5).randint(0, 10**9, 4).tolist()
    assert random.getstate() == py_before
    after = np.random.get_state()
    assert after[0] == np_before[0] and (after[1] == np_before[1]).all() and after[2:] == np_before[2:]


def test_rc_tasks_whose_levels_stop_changing_are_capped_there():
    """reasoning-core's combinatorics_formula and table_statistics configure nothing new above a level (identical
    problems at 10 and 26 as at 6): max_difficulty was None, so a curriculum climbed on them."""
    pytest.importorskip("reasoning_core")
    import reasoning_core as rc

    from envs.reasoning_core_adapter import LEVEL_TOPS

    for name, top in LEVEL_TOPS.items():
        assert get_env(f"rc/{name}").max_difficulty == top
        task = rc.get_task(name)

        def config(level):
            task.config.set_level(level)
            return {k: v for k, v in task.config.to_dict().items() if k not in ("seed", "level")}
        assert config(top) != config(top - 1) and config(top) == config(top + 1) == config(top + 30), name
    assert get_env("rc/arithmetics").max_difficulty is None


def test_rg_time_intervals_negative_gold_answers_are_kept_and_credited():
    """reasoning-gym's own gold answer can be negative ('-1 days, 16:01:00', ~3% of level 0): the check against a
    dropped minus sign refused every answer starting with '-', so the gold scored 0 and such problems were drawn
    again. The answer's sign must be the gold's: the gold without its minus sign is not credited."""
    pytest.importorskip("reasoning_gym")
    env = get_env("rg/time_intervals")
    cfg, _ = env.config(0)
    seed = next(s for s in range(300) if str(env._fresh(cfg, s)[1]["answer"]).startswith("-"))
    gold = str(env._fresh(cfg, seed)[1]["answer"])
    p = env.generate(seed, 0)
    assert p.answer == gold
    assert env.verify(p, f"<answer>{gold}</answer>").correct
    bad = env.verify(p, f"<answer>{gold[1:]}</answer>")
    assert not bad.correct and bad.reward == 0.0, bad


def test_rg_top_difficulty_is_a_level_reasoning_gym_accepts():
    """A level reasoning-gym rejects falls back to the level below, but max_difficulty compared the raw curriculum
    configurations: caesar_cipher's top (2) and rubiks_cube's (4) made the problems of the level below (levels used
    [0, 1, 1] and [0, 1, 2, 3, 3]), a promotion for nothing. The top is the highest level whose configuration, as
    used, differs from the one below's."""
    pytest.importorskip("reasoning_gym")
    assert (get_env("rg/caesar_cipher")._top, get_env("rg/rubiks_cube")._top) == (1, 3)
    for eid in [i for i in list_envs() if i.startswith("rg/")]:
        env = get_env(eid)
        top = env._top  # (the curriculum's own top: max_difficulty may be lowered by a recorded time cap)
        if top > 0:
            assert env.config(top)[1] == top and env.config(top)[0] != env.config(top - 1)[0], eid
    env = get_env("rg/caesar_cipher")
    assert [env.generate(s, 1).prompt for s in range(4)] != [env.generate(s, 0).prompt for s in range(4)]


def test_rg_self_reference_levels_make_the_same_problems_and_are_not_used():
    """reasoning-gym's self_reference passes its difficulty to helpers that ignore it: its 10 levels make identical
    problems, and a curriculum climbed them for nothing."""
    pytest.importorskip("reasoning_gym")
    env = get_env("rg/self_reference")
    cfg0, cfg9 = env._level_config(0), env._level_config(9)
    assert cfg0.difficulty != cfg9.difficulty
    assert env._fresh(cfg0, 3)[1]["question"] == env._fresh(cfg9, 3)[1]["question"]  # (what the cap rests on)
    assert env.max_difficulty == 0


def test_rg_time_intervals_reads_a_date_difference_whole():
    """reasoning-gym scores a date difference by its first word: "1 weeks" and "1 days and 23 hours" were credited
    for "1 days". The number of days, with or without its unit, is the answer."""
    env = get_env("rg/time_intervals")
    p = next(q for q in (env.generate(s, 0) for s in range(60)) if str(q.answer).endswith("days"))
    k = str(p.answer).split()[0]
    for wrong in (f"{k} weeks", f"{k} years", f"{k} days and 23 hours", f"{k} days9"):
        assert not env.verify(p, f"\\boxed{{{wrong}}}").correct, wrong
    for right in (str(p.answer), k):
        assert env.verify(p, f"\\boxed{{{right}}}").correct, right


@pytest.mark.skipif(not rlve_adapter.available(), reason="rlve-gym not installed")
def test_rlve_cornfield_is_left_out_for_its_constant_answer():
    """RLVE's Cornfield credits the empty answer (no operation) on most low-difficulty problems: not served."""
    from envs.rlve_adapter import EXCLUDED, RLVEEnv

    env = RLVEEnv("Cornfield")
    env.prepare()
    env.isolate = False  # the same scorer, in this process
    assert sum(env.verify(env.generate(s, 0), "<answer></answer>").correct for s in range(20)) >= 8
    assert "Cornfield" in EXCLUDED and "rlve/Cornfield" not in list_envs()


class _AlwaysSlow(Environment):
    """Its generator computes far past any bound at every difficulty."""

    def generate(self, seed, difficulty):
        _compute()
        return self.problem("say 1", "1", seed, difficulty)

    def check(self, problem, response):
        return Score(0.0, False, True)


def test_a_time_out_at_difficulty_0_is_a_failure_with_no_cap():
    (r,) = check_ids([f"{__name__}:_AlwaysSlow"], [0, 1], [0], jobs=1, gen_limit=0.3)
    assert r.cap is None and len(r.failures) == 1 and "at the lowest difficulty checked" in r.failures[0]
    assert "difficulty=0" in r.cap_reason


def test_check_ids_checks_each_difficulty_once_and_expand_ids_lists_each_id_once():
    from envs.check import expand_ids

    (r,) = check_ids(["toy/add"], [2, 0, 2], [0], in_process=True)
    assert r.failures == [] and r.stats["gen_n"] == 4     # 2 difficulties x 1 seed, generated twice each
    assert expand_ids(["toy/add", "toy/*", "toy/add"]).count("toy/add") == 1
    with pytest.raises(KeyError, match="no environment matches"):
        expand_ids(["nothere/*"])


def test_a_failed_check_keeps_a_recorded_cap(tmp_path):
    """A check that covered every difficulty above the cap but failed (it ran past its time, a worker died) says
    nothing about generation in time there: the cap stays."""
    from envs.check import CheckResult

    caps_file = tmp_path / "caps.json"
    caps_file.write_text(json.dumps({"x/slow": {"max_difficulty": 1, "reason": "difficulty=2 took over 10s"}}))
    failed = CheckResult("x/slow", ["x/slow: the check took over 300s"], 300.0, {}, None, "")
    assert update_caps([failed], [0, 1, 2, 3], caps_file, write=False)["x/slow"]["max_difficulty"] == 1
    ok = CheckResult("x/slow", [], 1.0, {}, None, "")
    assert "x/slow" not in update_caps([ok], [0, 1, 2, 3], caps_file, write=False)


# -- difficulty mapping, answer checks and score ranges of the adapters (mutation-testing additions) --------------
class _FixedScorer:
    """Stands in for a reasoning-gym dataset in an ``rg/`` check context: its ``score_answer`` gives ``value``."""

    def __init__(self, value):
        self.value = value

    def score_answer(self, answer, entry):
        return self.value


def test_rg_difficulty_outside_the_curriculum_is_clamped_to_its_levels():
    """Difficulty below 0 is level 0 and above the curriculum's top is the top: the same problem, and the problem
    says the level it was made at (not -2, not top + 3)."""
    pytest.importorskip("reasoning_gym")
    env = get_env("rg/basic_arithmetic")
    top = env._top
    assert top > 0
    low, zero = env.generate(3, -2), env.generate(3, 0)
    assert low.prompt == zero.prompt and low.meta["level"] == zero.meta["level"] == 0
    high, at_top = env.generate(3, top + 3), env.generate(3, top)
    assert high.prompt == at_top.prompt and high.meta["level"] == at_top.meta["level"] == top
    assert env.config(-2) == env.config(0) and env.config(top + 3) == env.config(top)


def test_rg_levels_take_the_upper_bound_mode_where_reasoning_gym_accepts_it():
    """A level's configuration is reasoning-gym's UPPER_BOUND mode (the level's own range: basic_arithmetic's level 1
    has 3 terms of 2 digits at least), the INCLUSIVE mode (from level 0's minimum: 2 terms, 1 digit) only where
    reasoning-gym refuses the first."""
    pytest.importorskip("reasoning_gym")
    cfg, level = get_env("rg/basic_arithmetic").config(1)
    assert level == 1 and (cfg.min_terms, cfg.min_digits) == (3, 2)
    cfg, level = get_env("rg/base_conversion").config(1)
    assert level == 1 and (cfg.min_base, cfg.min_value) == (9, 10000)


def test_rg_full_credit_only_at_a_score_of_one_and_exact_checks_after_it():
    """``correct`` is reasoning-gym's full credit (1.0); a partial score is the reward, not correct; on an ``EXACT``
    dataset a full score the exact check refuses is 0; a response without an answer never reaches the scorer."""
    pytest.importorskip("reasoning_gym")
    env = get_env("rg/basic_arithmetic")
    p = env.generate(0, 0)
    entry = {"question": p.prompt, "answer": p.answer, "metadata": {}}
    half = env.check_with(p, "\\boxed{7}", (_FixedScorer(0.5), entry))
    assert (half.reward, half.correct, half.format_ok) == (0.5, False, True)
    assert half.info["extracted"] == "7" and half.info["rg_score"] == 0.5
    full = env.check_with(p, "<answer> 7 </answer>", (_FixedScorer(1), entry))
    assert (full.reward, full.correct) == (1.0, True) and full.info["extracted"] == "7"
    none = env.check_with(p, "I think it is 7", (_FixedScorer(1), entry))
    assert (none.reward, none.correct, none.format_ok) == (0.0, False, False)
    jumble = get_env("rg/letter_jumble")
    q = jumble.generate(0, 0)
    gold = {"question": q.prompt, "answer": "the cat", "metadata": {}}
    ok = jumble.check_with(q, "\\boxed{The Cat}", (_FixedScorer(1.0), gold))
    assert ok.correct and ok.reward == 1.0  # (letter case aside, the same text)
    bad = jumble.check_with(q, "\\boxed{the cat sat}", (_FixedScorer(1.0), gold))
    assert (bad.reward, bad.correct) == (0.0, False) and "not exactly right" in bad.info["reason"]


def test_rg_exact_checks_read_plain_numbers():
    """gsm_symbolic's exact check takes a plain number: thousands separators and a dollar sign are fine, a minus
    sign is part of it (a negative gold answer is credited, its absolute value is not)."""
    pytest.importorskip("reasoning_gym")
    from envs.reasoning_gym_adapter import EXACT

    gsm = EXACT["gsm_symbolic"]
    assert gsm("$1,234", {"answer": "1234"}) and gsm(" 1234 ", {"answer": "1234"}) and gsm("12.5", {"answer": "12.5"})
    assert gsm("-28080", {"answer": "-28080"}) and not gsm("28080", {"answer": "-28080"})
    assert not gsm("-28080", {"answer": "28080"}) and not gsm("1234 or 7", {"answer": "1234"})
    assert EXACT["letter_jumble"]("Hello World ", {"answer": "hello world"})
    assert EXACT["spell_backward"]("OLLEH", {"answer": "olleh"}) and not EXACT["spell_backward"]("olleh!", {"answer": "olleh"})


def test_rg_a_problem_whose_prompt_is_not_the_regenerated_one_is_scored_against_its_own_answer():
    """A problem whose (seed, difficulty) now makes another question (a generator not reproducible across
    processes) is graded against the problem's own gold answer, not the regenerated item's."""
    pytest.importorskip("reasoning_gym")
    env = get_env("rg/basic_arithmetic")
    p1, p2 = env.generate(1, 0), env.generate(2, 0)
    assert str(p1.answer) != str(p2.answer)
    q = Problem(p2.prompt, p2.answer, p1.env_id, p1.seed, p1.difficulty, dict(p2.meta))
    assert env.verify(q, f"\\boxed{{{p2.answer}}}").correct
    assert not env.verify(q, f"\\boxed{{{p1.answer}}}").correct


def test_rg_and_rc_keep_a_problem_even_when_their_scorer_credits_no_draw_of_it():
    """A problem whose reference the scorer never credits is drawn again, and the first draw is kept when every
    draw is such (generation does not fail)."""
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("reasoning_core")
    from envs.reasoning_core_adapter import ReasoningCoreEnv
    from envs.reasoning_gym_adapter import ReasoningGymEnv

    for env, plain in ((ReasoningGymEnv("basic_arithmetic"), ReasoningGymEnv("basic_arithmetic")),
                       (ReasoningCoreEnv("arithmetics"), ReasoningCoreEnv("arithmetics"))):
        env.reference_credited = lambda problem, context: False
        got = env.generate(5, 1)
        want = plain.generate(5, 1)
        assert (got.prompt, got.answer, got.meta["level"]) == (want.prompt, want.answer, want.meta["level"]), env.id


def test_rc_scores_are_clamped_to_zero_one_and_full_credit_is_one():
    """reasoning-core's score in [0, 1] is the reward: a scorer's negative, NaN or above-one value is clamped (NaN is
    0), only full credit is correct, and the scorer gets the extracted answer."""
    pytest.importorskip("reasoning_core")
    from envs.reasoning_core_adapter import ReasoningCoreEnv

    env = ReasoningCoreEnv("arithmetics")
    p = env.generate(0, 0)
    seen = []
    for value, reward, correct in ((-0.5, 0.0, False), (float("nan"), 0.0, False), (1.7, 1.0, True),
                                   (0.5, 0.5, False), (0.999, 0.999, False), (1.0, 1.0, True)):
        env._scorer = lambda pred, entry, v=value: seen.append(pred) or v
        s = env.check_with(p, "<think>\\boxed{1}</think>so \\boxed{ 42 }", p.meta["rc_metadata"])
        assert (s.reward, s.correct, s.format_ok) == (reward, correct, True), value
        assert s.info["rc_score"] == reward
    assert set(seen) == {"42"}
    s = env.check_with(p, "no answer here", p.meta["rc_metadata"])
    assert (s.reward, s.correct, s.format_ok) == (0.0, False, False) and len(seen) == 6
    # an aggregation prompt built on the problem: the scorer sees the problem's own question, answer and metadata
    import dataclasses

    agg = dataclasses.replace(p, prompt="Here are 4 candidate solutions ...", meta={**p.meta, "question": p.prompt})
    entries = []
    env._scorer = lambda pred, entry: entries.append(entry) or 1.0
    assert env.check_with(agg, "\\boxed{42}", agg.meta["rc_metadata"]).correct
    assert (entries[0].prompt, entries[0].answer, entries[0].metadata) == (p.prompt, p.answer, p.meta["rc_metadata"])


def test_rc_difficulty_below_zero_is_level_zero_and_a_failing_level_falls_back_below():
    pytest.importorskip("reasoning_core")
    from envs.reasoning_core_adapter import ReasoningCoreEnv

    env = ReasoningCoreEnv("arithmetics")
    low, zero = env.generate(4, -1), env.generate(4, 0)
    assert (low.prompt, low.meta["level"]) == (zero.prompt, 0)
    flaky = ReasoningCoreEnv("arithmetics")
    real = flaky._generate_at

    def fails_above_zero(seed, level):
        if level >= 1:
            raise ValueError("reasoning-core failed at this level")
        return real(seed, level)
    flaky._generate_at = fails_above_zero
    p = flaky.generate(4, 1)
    assert p.difficulty == 1 and p.meta["level"] == 0 and p.prompt == zero.prompt
    flaky._generate_at = lambda seed, level: (_ for _ in ()).throw(ValueError("never"))
    with pytest.raises(RuntimeError, match="failed to generate"):
        flaky.generate(4, 2)


def test_rc_check_context_is_the_problems_own_metadata():
    """The entry is rebuilt from the problem's own ``rc_metadata``; only a problem without it is regenerated."""
    pytest.importorskip("reasoning_core")
    env = get_env("rc/arithmetics")
    p = env.generate(2, 1)
    mine = Problem(p.prompt, p.answer, p.env_id, p.seed, p.difficulty, {**p.meta, "rc_metadata": {"mine": 1}})
    assert env.check_context(mine) == {"mine": 1}
    bare = Problem(p.prompt, p.answer, p.env_id, p.seed, p.difficulty, {})
    assert env.check_context(bare) == p.meta["rc_metadata"]


def test_rlve_difficulty_below_zero_is_the_controllers_first_level():
    _rlve()
    env = get_env("rlve/AdditionTable")
    first = env.parameter_list(0)
    env.parameter_list(3)
    assert env.parameter_list(-1) == first == [{"N": 3}]
    assert env.generate(0, -2).prompt == env.generate(0, 0).prompt


def test_rlve_large_seeds_generate_with_a_32_bit_generator_seed():
    """RLVE seeds numpy (32-bit seeds): a curriculum's 62-bit seed generates, and the generator seed it records
    makes the same problem with RLVE's own generator."""
    gym_envs, _ = _rlve()
    env = get_env("rlve/Multiplication")
    big = (1 << 40) + 12345
    p = env.generate(big, 1)
    assert p.meta["rlve_seed"] == big % (1 << 32)
    own = gym_envs.identifier2environment["Multiplication"]()
    assert own.generator(seed=p.meta["rlve_seed"], parameter=p.meta["parameter"])
    assert p.prompt.startswith(own.prompt_generator())
    assert env.verify(p, env.reference_response(p)).correct


def test_rlve_a_level_with_several_parameters_draws_among_them_by_seed():
    _rlve()
    env = get_env("rlve/CycleCounting")
    plist = env.parameter_list(0)
    assert len(plist) == 4
    chosen = [env.generate(s, 0).meta["parameter"] for s in range(16)]
    assert all(c in plist for c in chosen) and len({json.dumps(c, sort_keys=True) for c in chosen}) >= 2
    assert chosen == [get_env("rlve/CycleCounting").generate(s, 0).meta["parameter"] for s in range(16)]


def test_rlve_answers_after_thinking_only_and_no_overlong_ones():
    """An answer inside the thinking is no answer (RLVE's format penalty, -1), an answer longer than the bound is
    refused before RLVE's scorer (-1, said so), and a problem that is not the regenerated one is flagged."""
    _rlve()
    env = get_env("rlve/Multiplication")
    p = env.generate(0, 0)
    assert env.extract(f"<think><answer>{p.answer}</answer></think>I give up") is None
    assert env.extract(f"<think>x</think><answer> {p.answer}</answer>") == f" {p.answer}"
    hidden = env.verify(p, f"<think><answer>{p.answer}</answer></think>I give up")
    assert (hidden.reward, hidden.correct, hidden.format_ok) == (-1.0, False, False)
    long = env.verify(p, "<answer>" + "1" * 20_000 + "</answer>")
    assert (long.reward, long.correct, long.format_ok) == (-1.0, False, False)
    assert long.info["reason"] == "answer too long" and long.info["length"] == 20_000
    other = Problem("another question", p.answer, p.env_id, p.seed, p.difficulty, dict(p.meta))
    s = env.verify(other, env.reference_response(other))
    assert s.correct and "differs" in s.info["warning"]
    assert "warning" not in env.verify(p, env.reference_response(p)).info


def test_rc_leaves_fakers_shared_random_state_as_it_found_it():
    """Faker's generators share one random.Random: a reasoning-core problem is drawn from it seeded by the problem's
    seed (the same problem whatever state it had), and the caller's state is put back afterwards."""
    pytest.importorskip("reasoning_core")
    from envs.reasoning_core_adapter import ReasoningCoreEnv

    first = ReasoningCoreEnv("set_missing_element")
    first.prepare()  # (imports the task's modules, Faker's among them)
    shared = sys.modules["faker.generator"].random
    shared.seed(123)
    before = shared.getstate()
    a = first.generate(5, 1)
    assert shared.getstate() == before
    other = ReasoningCoreEnv("set_missing_element")
    shared.seed(999)
    assert other.generate(5, 1).prompt == a.prompt


# -- difficulty caps and the run-time bound: details (mutation-found gaps) ---------------------------
def test_no_difficulty_caps_switch_reads_0_as_off(monkeypatch):
    from envs import caps

    for value, off in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("CASCADE_NO_DIFFICULTY_CAPS", value)
        assert caps.disabled() is off, value
        bounded = getattr(get_env("test/slow_gen").generate, "__wrapped__", None) is not None
        assert bounded is not off, value


def test_load_caps_keeps_well_formed_entries_and_reads_a_changed_file(tmp_path):
    f = tmp_path / "caps.json"
    f.write_text(json.dumps({"a": {"max_difficulty": 2, "reason": "r"}, "b": 5, "c": {"max_difficulty": "2"},
                             "d": {}, "e": {"max_difficulty": 0}}))
    assert load_caps(f) == {"a": {"max_difficulty": 2, "reason": "r"}, "e": {"max_difficulty": 0}}
    f.write_text(json.dumps({"z": {"max_difficulty": 1}}))
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # a later edit (same-second writes aside)
    assert load_caps(f) == {"z": {"max_difficulty": 1}}
    f.write_text("{not json")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000_000))
    assert load_caps(f) == {}
    assert load_caps(tmp_path / "missing.json") == {}


def test_a_recorded_cap_only_lowers_max_difficulty(tmp_path, monkeypatch):
    f = tmp_path / "caps.json"
    monkeypatch.delenv("CASCADE_NO_DIFFICULTY_CAPS", raising=False)
    monkeypatch.setenv("CASCADE_DIFFICULTY_CAPS", str(f))
    top = type(get_env("toy/add")).max_difficulty
    assert top is not None and top > 5
    f.write_text(json.dumps({"toy/add": {"max_difficulty": top + 100, "reason": "r"}}))
    assert get_env("toy/add").max_difficulty == top
    f.write_text(json.dumps({"toy/add": {"max_difficulty": 3, "reason": "r"}}))
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 5_000_000_000))
    assert get_env("toy/add").max_difficulty == 3
    # a corrupt file is no caps, not an error
    f.write_text("{")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10_000_000_000))
    assert get_env("toy/add").max_difficulty == top


class _SlowEverySeed(_SlowGen):
    """Slow at difficulty 0 for every seed; records the seeds asked for."""

    def __init__(self):
        self.seeds = []

    def generate(self, seed, difficulty):
        self.seeds.append(seed)
        _compute()


def test_run_time_bound_tries_three_other_seeds_then_fails():
    from envs.caps import GenerationTimeout

    env = _SlowEverySeed()
    bound_generate(env, 0.2)
    t = time.perf_counter()
    with pytest.raises(GenerationTimeout, match="at difficulty 0 for seed 5 and 3 derived seeds"):
        env.generate(5, 0)
    assert time.perf_counter() - t < 15  # (not the 30 s its generator sleeps)
    assert len(env.seeds) == 4 and env.seeds[0] == 5 and len(set(env.seeds)) == 4, env.seeds


class _RaisingGen(_SlowGen):
    def generate(self, seed, difficulty):
        raise ValueError(f"no problem at {difficulty}")


def test_run_time_bound_passes_the_generators_error_on():
    env = _RaisingGen()
    bound_generate(env, 1.0)
    with pytest.raises(ValueError, match="no problem at 1"):
        env.generate(0, 1)


def test_cli_check_no_record_and_module_ids_leave_the_caps_file_alone(tmp_path, capsys):
    caps_file = tmp_path / "caps.json"
    for ids in (["test/slow_gen", "--no-record"], [f"{__name__}:_SlowGen"]):
        assert envs_main(["check", *ids, "--difficulties", "0-2", "--seeds", "1", "--gen-limit", "0.3",
                          "--caps", str(caps_file)]) == 0
        assert "capped at difficulty 1" in capsys.readouterr().out, ids
        assert not caps_file.exists(), ids


def test_cli_check_reports_the_slowest_environment_first(capsys):
    assert envs_main(["check", "toy/add", "test/slow_gen", "--difficulties", "0-2", "--seeds", "1",
                      "--gen-limit", "0.3", "--no-record", "--slowest", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = lines.index("slowest 1 environments:")
    assert "test/slow_gen" in lines[i + 1] and "toy/add" not in lines[i + 1]
