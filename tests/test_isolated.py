"""Third-party verifiers in worker processes (envs/isolated.py, envs/workers.py): deadlines, safe eval,
confinement, and scores equal to the in-process ones."""
from __future__ import annotations

import os
import time

import pytest

from envs.base import Environment, Problem, Score, get_env
from envs.isolated import IsolatedCheck, _POOL, confinement, safe_eval


class Chatty(IsolatedCheck, Environment):
    """Prints to stdout while scoring (the worker's answers must survive it); sleeps on "sleep"."""

    verify_time_limit = 2.0

    def generate(self, seed: int, difficulty: int) -> Problem:
        return self.problem("say ok", "ok", seed, difficulty)

    def check_context(self, problem: Problem):
        print("context noise")
        return {"gold": problem.answer}

    def check_with(self, problem: Problem, response: str, context) -> Score:
        print("scoring noise\nmore")
        if response == "sleep":
            time.sleep(60)
        if response.startswith("spawn "):  # a scorer that starts a process and then hangs
            import subprocess

            child = subprocess.Popen(["sleep", "600"])
            with open(response.split(" ", 1)[1], "w") as f:
                f.write(str(child.pid))
            time.sleep(60)
        if response == "raise":
            raise KeyError("the scorer broke")
        if response == "hog":  # more memory than a worker may take
            from envs.isolated import WORKER_DATA_BYTES

            bytearray(WORKER_DATA_BYTES + (1 << 30))
        if response == "status":  # what the worker may do: its capabilities, its memory; what it imported
            import resource
            import sys

            caps = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("CapEff")]
            return Score(0.0, False, True, {"cap_eff": int(caps[0], 16), "torch": "torch" in sys.modules,
                                            "data_limit": resource.getrlimit(resource.RLIMIT_DATA)[0]})
        ok = response.strip() == context["gold"]
        return Score(float(ok), ok, True, {"pid": os.getpid()})


def test_safe_eval_takes_data_and_arithmetic_only():
    secret = [4, 2]  # noqa: F841 - the caller's variables are not an expression's names
    assert safe_eval("[1, 2, (3, 'a')]") == [1, 2, (3, "a")]
    assert safe_eval("{'a': -1.5, 'b': [True, None]}") == {"a": -1.5, "b": [True, None]}
    assert safe_eval("(0x3a << 3) ^ 7 + 2 ** 10 // 3 % 5") == (0x3a << 3) ^ 7 + 2 ** 10 // 3 % 5
    assert safe_eval("[1, 2, 3][1:]") == [2, 3] and safe_eval("1 < 2 <= 2 and not 0") is True
    assert safe_eval("x + 1", {"x": 4}) == 5 and safe_eval("{'p': nan}")["p"] != 0
    for bad in ("__import__('os').system('true')", "open('/tmp/x', 'w')", "().__class__.__bases__",
                "(lambda: 1)()", "[x for x in range(3)]", "10 ** 10 ** 10", "1 << 10 ** 6", "'a' * 10 ** 9",
                "safe_eval", "secret", "secret[0]"):
        with pytest.raises((ValueError, SyntaxError)):
            safe_eval(bad)


def test_worker_scores_survive_printing_errors_and_hangs():
    env = get_env("tests.test_isolated:Chatty")
    p = env.generate(0, 0)
    good, bad = env.verify(p, "ok"), env.verify(p, "no")
    assert (good.correct, bad.correct) == (True, False) and good.info["pid"] != os.getpid()  # scored elsewhere
    err = env.verify(p, "raise")
    assert err.reward == 0 and "KeyError" in err.info["error"] and "the scorer broke" in err.info["error"]
    t = time.monotonic()
    hung = env.verify(p, "sleep")
    assert time.monotonic() - t < env.verify_time_limit + 3
    assert hung.reward == 0 and "did not finish in time" in hung.info["reason"]
    assert env.verify(p, "ok").correct  # a new worker took over
    if confinement():  # no capabilities (as root it could remount / read-write otherwise)
        assert env.verify(p, "status").info["cap_eff"] == 0


@pytest.mark.parametrize("env_id,answer", [
    ("rg/string_insertion", "<answer>open({path!r}, 'w').write('x') and 'ab'</answer>"),  # the scorer evals it
    ("rc/sequential_induction", "<answer>__import__('os').system('touch {path}')</answer>"),  # sympify evals it
    # sympy's parse_expr evals it; the exec would also have rewritten the worker's scorer for later answers
    ("rg/polynomial_multiplication", "<answer>__import__('builtins').exec(\"open({path!r}, 'w')\")</answer>"),
    ("rg/polynomial_multiplication", "<answer>lambdify(x, \"open({path!r}, 'w')\")(1)</answer>"),
])
def test_a_scorer_never_runs_the_answer(env_id, answer, tmp_path, monkeypatch):
    """Neither the packages' eval (safe_eval) nor sympy's parser (check_sympy_code) runs an answer's Python:
    the workers here run unconfined, so bwrap's read-only filesystem is not what stops the write."""
    pytest.importorskip(env_id.startswith("rg/") and "reasoning_gym" or "reasoning_core")
    monkeypatch.setenv("CASCADE_VERIFY_UNCONFINED", "1")
    _POOL.close()  # the confined workers go; this test's start unconfined
    try:
        env, path = get_env(env_id), tmp_path / "ran"
        p = env.generate(3, 1)
        s = env.verify(p, answer.format(path=str(path)))
        assert s.reward <= 0 and not path.exists(), s
        assert env.verify(p, env.reference_response(p)).correct
    finally:
        _POOL.close()


@pytest.mark.parametrize("env_id,answer", [
    ("rg/string_insertion", "oracle_answer"), ("rg/n_queens", "entry['metadata']['solutions'][0]"),
    ("rg/binary_matrix", "entry['metadata']['solution']"), ("rg/spiral_matrix", "entry['metadata']['solution']"),
])
def test_an_answer_naming_the_scorers_variable_that_holds_the_reference_scores_nothing(env_id, answer):
    """These scorers ``eval(answer)`` with no scope given: an answer naming the scorer's local that holds the
    reference (the item, or the oracle answer) was that reference and earned partial credit on every problem
    (0.5 on n_queens, 0.1 on the others) for nothing. safe_eval never reads the caller's variables."""
    pytest.importorskip("reasoning_gym")
    env = get_env(env_id)
    for seed in range(2):
        p = env.generate(seed, 0)
        assert env.verify(p, f"<answer>{answer}</answer>").reward <= 0, (env_id, seed)
        assert env.verify(p, env.reference_response(p)).correct


def test_a_stopped_worker_takes_the_processes_its_scorer_started_with_it(tmp_path, monkeypatch):
    """Unconfined (no bwrap to take the sandbox down), a worker stopped at its deadline left running what its
    scorer had started."""
    from envs.workers import proc_stat

    monkeypatch.setenv("CASCADE_VERIFY_UNCONFINED", "1")
    _POOL.close()
    try:
        env, pidfile = get_env("tests.test_isolated:Chatty"), tmp_path / "pid"
        s = env.verify(env.generate(0, 0), f"spawn {pidfile}")
        assert s.reward == 0 and "did not finish" in s.info["reason"], s
        pid = int(pidfile.read_text())
        deadline = time.monotonic() + 10
        while (st := proc_stat(pid)) is not None and st[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = st is not None and st[0] != "Z"
        if alive:
            os.kill(pid, 9)
        assert not alive, "the scorer's process outlived its worker"
    finally:
        _POOL.close()


def test_sympy_code_of_an_answer_names_only_mathematics():
    from envs.isolated import check_sympy_code

    for ok in ("Integer (3 )*Symbol ('x' )**Integer (2 )+sqrt (Integer (2 ))", "Eq (Symbol ('y' ),pi )",
               "Matrix ([[Integer (1 ),Integer (2 )]])[Integer (0 ),Integer (1 )]", "factorial (Integer (5 ))",
               "Float ('1.5' ,precision =53 )", "abs (Integer (-2 ))", "f (Integer (1 ))"):
        check_sympy_code(ok, local_names={"f"})
    for bad in ("__import__ ('os' )", "exec ('1' )", "open ('/tmp/x' ,'w' )", "lambdify (Symbol ('x' ),'1' )",
                "Symbol ('x' ).__class__", "Symbol ('x' ).subs", "(lambda :1 )()", "[Integer (1 )for x in []]",
                "preview (Symbol ('x' ))", "var ('x' )", "init_session ()", "f (Integer (1 ))", "1 +"):
        with pytest.raises(ValueError):
            check_sympy_code(bad)
    # a call of what a call made (a problem's ODE: Function('y')(x)), and compiled code (parse_expr with
    # evaluate=False): reasoning-core's inverse_math parses both to score an answer, and scored right answers 0
    check_sympy_code("Derivative (Function ('y' )(Symbol ('x' )),Symbol ('x' ))")
    check_sympy_code(compile("Add(Symbol('x'), Integer(2), evaluate=False)", "<string>", "eval"))
    for bad in ("open('/tmp/x', 'w')", "Symbol('x').__class__", "(lambda: 1)()", "[x for x in []]", "__import__('os')"):
        with pytest.raises(ValueError):
            check_sympy_code(compile(bad, "<string>", "eval"))


def test_adapters_draw_again_a_problem_whose_own_answer_their_scorer_fails():
    """reasoning-core's inverse_math scored 8 of 20 of its own answers 0 in the worker (our sympy check refused the
    code its scorer parses); reasoning-gym's jugs makes unsolvable puzzles it scores "No solution" 0 on, and
    string_manipulation empty answers no box holds: such a problem is drawn again."""
    pytest.importorskip("reasoning_core")
    pytest.importorskip("reasoning_gym")
    for env_id, seeds in (("rc/inverse_math", range(7, 13)), ("rg/jugs", range(6, 7)), ("rg/string_manipulation", (5,))):
        env = get_env(env_id)
        for s in seeds:
            p = env.generate(s, 2)
            assert env.verify(p, env.reference_response(p)).correct, (env_id, s)


def test_a_scorer_that_never_returns_is_stopped():
    pytest.importorskip("reasoning_core")
    env = get_env("rc/sequential_induction")  # sympy raises 10 to 10**10 for ever
    env.verify_time_limit = 3.0
    p = env.generate(1, 1)
    assert env.verify(p, env.reference_response(p)).correct  # (the worker started: the clock is the score's)
    t = time.monotonic()
    s = env.verify(p, "<answer>10**10**10</answer>")
    assert time.monotonic() - t < 3.0 + 3 and s.reward == 0 and "did not finish in time" in s.info["reason"]
    # the same answers score the same in this process
    env.isolate = False
    assert env.verify(p, env.reference_response(p)).correct and not env.verify(p, "<answer>7</answer>").correct


def test_safe_eval_refuses_string_formatting_before_it_allocates():
    """``%``-formatting takes its width from the operands ("%*d" % (1 << 34, 7) is 16 GiB): refused
    before it runs, not measured after (tracemalloc sees every allocation of the string)."""
    import tracemalloc

    for src in ('"%*d" % (1 << 26, 7)', 'b"%*d" % (1 << 26, 7)', '"%99999999d" % 1', '"%.99999999d" % 1',
                '"%s" % "x"'):
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match="safe_eval"):
                safe_eval(src)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (src, peak)
    assert safe_eval("7 % 3") == 1 and safe_eval("-7.5 % 2") == 0.5  # arithmetic % still works


_WORKER_MODULE = '''
import os, time
from envs.workers import serve


def worker_main():
    def handle(req, emit):
        if req == "crash":
            os._exit(3)
        if req == "hang":
            time.sleep(60)
        if req == "pid":
            return os.getpid()
        return req
    serve(handle)
'''


def test_workers_tell_a_crash_from_a_deadline_and_take_descriptors_past_1023(tmp_path, monkeypatch):
    """A worker that died was reported as one that ran out of time; with more than 1,023 descriptors held, select()
    refused the worker's pipe and every isolated or math verify scored zero (and left its worker running); a pool
    whose confined workers had started ran a later one unconfined, unsaid, when a confined start failed."""
    import resource

    from envs.workers import Pool, WorkerStartError

    (tmp_path / "toyworker.py").write_text(_WORKER_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = Pool("toyworker", 60)
    try:
        assert pool.call("x", [30]) == ["x"] and pool.failure() is None
        assert pool.call("crash", [30]) is None and pool.failure() == "died"
        assert pool.call("hang", [0.5]) is None and pool.failure() == "timeout"
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard < 1200:
            pytest.skip("this machine's descriptor limit is under 1,200")
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        try:
            pool.close()  # a new worker, its pipes past 1,023
            assert pool.call("y", [30]) == ["y"]
        finally:
            for fd in held:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        pool.close()
    flag = tmp_path / "started-once"
    wrap = tmp_path / "wrap.sh"
    wrap.write_text(f'#!/bin/sh\nif [ -e {flag} ]; then exit 1; fi\ntouch {flag}\nexec "$@"\n')
    wrap.chmod(0o755)
    pool = Pool("toyworker", 60, wrap=lambda: [str(wrap)])
    try:
        assert pool.call("z", [30]) == ["z"] and pool.wrapped is True
        pool.close()
        with pytest.raises(WorkerStartError):
            pool.call("z", [30])
    finally:
        pool.close()


def test_a_forked_child_starts_its_own_workers_and_leaves_the_parents_alone(tmp_path, monkeypatch):
    """After a fork the child's copy of the pool holds the parent's idle workers, whose pipes the parent still
    reads: the child starts a worker of its own, and the parent's worker answers the parent as before."""
    from envs.workers import Pool

    (tmp_path / "toyworker.py").write_text(_WORKER_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = Pool("toyworker", 60)
    try:
        parents = pool.call("pid", [30])[0]
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # (the child reports its worker's pid, or -1 on any error, and leaves at once)
            try:
                os.close(r)
                got = pool.call("pid", [30])[0]
                pool.close()
            except BaseException:  # noqa: BLE001
                got = -1
            os.write(w, str(got).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            childs = int(f.read())
        os.waitpid(child, 0)
        assert childs not in (-1, parents)
        assert pool.call("pid", [30]) == [parents]  # the parent's worker, untouched
    finally:
        pool.close()


def test_safe_eval_bounds_the_total_of_a_value_that_repeats_one_object():
    """Each list and string within MAX_ITEMS, but one row held 100,000 times: ``[['a'*100000]*100000]*2`` passed, and
    a scorer's str() or join of it (spiral_matrix, binary_matrix, n_queens, string_insertion) took 4 GB and more
    before its deadline stopped it. The weight of a value counts each element, character and digit every time it
    appears."""
    from envs.isolated import MAX_ITEMS

    for bomb in ("[['a'*100000]*100000]*2", "[[0]*100000]*100000", "[2**8000]*100000", "['ab'*60000]*2",
                 "[['x']*60000]+[['y']*60000]*2", "(('a'*1000,)*100,)*100"):
        t = time.monotonic()
        with pytest.raises(ValueError, match="safe_eval"):
            safe_eval(bomb)
        assert time.monotonic() - t < 1, bomb
    assert safe_eval("[[0]*3]*2") == [[0, 0, 0]] * 2 and len(safe_eval(f"'a'*{MAX_ITEMS}")) == MAX_ITEMS
    assert safe_eval("[['ab']*10]*10+[[1]]")[-1] == [1] and safe_eval("'ab'*3 + 'c'") == "abababc"


def test_an_answer_that_repeats_one_row_scores_nothing_at_once():
    """A 40-character answer whose text is ~20 GB: refused by safe_eval (the scorer catches the error), not rendered
    until the deadline kills the worker."""
    pytest.importorskip("reasoning_gym")
    env = get_env("rg/spiral_matrix")
    p = env.generate(0, 0)
    assert env.verify(p, env.reference_response(p)).correct  # (the worker started: the clock is the score's)
    t = time.monotonic()
    s = env.verify(p, "<answer>[['a'*100000]*100000]*2</answer>")
    assert time.monotonic() - t < 3 and s.reward == 0 and "did not finish" not in str(s.info), s


def test_a_worker_has_a_memory_limit_and_one_that_imported_torch_works_under_it():
    """Workers had no memory limit (the message of a dead one said they had): ``verify_workers`` of them rendering
    answers of gigabytes could exhaust the host. An allocation past the limit is a ``MemoryError`` (a zero score
    with the error; the worker goes on); a worker that imported torch (rlve-gym's scorers do) still scores."""
    from envs.isolated import WORKER_DATA_BYTES

    _POOL.close()
    try:
        env = get_env("tests.test_isolated:Chatty")
        p = env.generate(0, 0)
        hog = env.verify(p, "hog")
        assert hog.reward == 0 and "MemoryError" in hog.info["error"], hog
        assert env.verify(p, "ok").correct
        pytest.importorskip("Gym")
        rlve = get_env("rlve/Multiplication")
        q = rlve.generate(0, 3)
        assert rlve.verify(q, rlve.reference_response(q)).correct and not rlve.verify(q, "<answer>-1</answer>").correct
        status = env.verify(p, "status").info  # (the same worker: one caller)
        assert status["torch"] and status["data_limit"] == WORKER_DATA_BYTES, status
        assert "MemoryError" in env.verify(p, "hog").info["error"] and env.verify(p, "ok").correct
    finally:
        _POOL.close()


# -- crashes, contexts, short-circuit logic (mutation-testing additions) -----------------------------------------
class Crashy(IsolatedCheck, Environment):
    """Its scorer's process dies on "crash"; its context says where it was made (and weighs ``pad`` characters)."""

    verify_time_limit = 5.0

    def generate(self, seed: int, difficulty: int) -> Problem:
        return self.problem("say ok", "ok", seed, difficulty, pad=seed)

    def check_context(self, problem: Problem):
        return {"gold": problem.answer, "pid": os.getpid(), "pad": "x" * problem.meta["pad"]}

    def check_with(self, problem: Problem, response: str, context) -> Score:
        if response == "crash":
            os._exit(7)
        ok = response == context["gold"]
        return Score(float(ok), ok, True, {"context_pid": context["pid"], "pid": os.getpid()})


def test_a_crashed_scorer_is_a_zero_said_so_and_the_next_answer_gets_a_new_worker():
    env = get_env("tests.test_isolated:Crashy")
    p = env.generate(0, 0)
    first = env.verify(p, "ok")
    assert first.correct
    t = time.monotonic()
    dead = env.verify(p, "crash")
    assert time.monotonic() - t < env.verify_time_limit
    assert (dead.reward, dead.correct) == (0.0, False) and "process died" in dead.info["reason"], dead
    again = env.verify(p, "ok")
    assert again.correct  # (a new worker: the crashed one is not reused)


def test_a_small_context_is_made_by_the_caller_and_a_large_one_by_the_worker():
    from envs.isolated import SHIP_CONTEXT_BYTES

    env = get_env("tests.test_isolated:Crashy")
    small = env.verify(env.generate(0, 0), "ok")
    assert small.correct and small.info["context_pid"] == os.getpid() != small.info["pid"]
    large = env.verify(env.generate(SHIP_CONTEXT_BYTES + 1000, 0), "ok")
    assert large.correct and large.info["context_pid"] == large.info["pid"] != os.getpid()


def test_a_response_without_an_answer_is_scored_without_a_worker(monkeypatch):
    pytest.importorskip("reasoning_gym")
    from envs import isolated

    env = get_env("rg/basic_arithmetic")
    p = env.generate(0, 0)

    class NoPool:
        def call(self, *a, **k):
            raise AssertionError("a worker was asked")
    monkeypatch.setattr(isolated, "_POOL", NoPool())
    s = env.verify(p, "I don't know.")
    assert (s.reward, s.correct, s.format_ok) == (0.0, False, False) and "no \\boxed{}" in s.info["reason"], s


def test_safe_eval_boolean_and_comparison_chains_are_pythons():
    assert safe_eval("0 or 5") == 5 and safe_eval("2 and 3") == 3 and safe_eval("1 and 0") == 0
    assert safe_eval("[] or 'x'") == "x" and safe_eval("0 and 1 / 0") == 0 and safe_eval("1 or 1 / 0") == 1
    assert safe_eval("1 < 3 < 2") is False and safe_eval("3 > 2 > 1") is True and safe_eval("1 == 1 != 2") is True
    assert safe_eval("x", {"x": [1, 2]}) == [1, 2]
    for not_data in ({"f": print}, {"f": os}, {"f": [1, print]}):
        with pytest.raises(ValueError, match="not a data value"):
            safe_eval("f", not_data)


_WORKER_MODULE_2 = '''
import os
from envs.workers import serve


def worker_main():
    def handle(req, emit):
        if req == "pid":
            return os.getpid()
        if req == "fail":
            raise ValueError("boom")
        return req
    serve(handle)
'''

_NOT_READY_MODULE = '''
def worker_main():
    print("hello")
'''


def _gone(pid, wait=10.0):
    from envs.workers import proc_stat

    deadline = time.monotonic() + wait
    while (st := proc_stat(pid)) is not None and st[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    return st is None or st[0] == "Z"


def test_pool_replaces_a_dead_idle_worker_answers_errors_at_once_and_close_stops_workers(tmp_path, monkeypatch):
    import signal

    from envs.workers import Pool, WorkerStartError

    (tmp_path / "toyworker2.py").write_text(_WORKER_MODULE_2)
    (tmp_path / "notready.py").write_text(_NOT_READY_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = Pool("toyworker2", 60)
    try:
        (pid,) = pool.call("pid", [30])
        os.kill(pid, signal.SIGKILL)  # the idle worker dies between calls
        assert _gone(pid)
        assert pool.call("y", [30]) == ["y"] and pool.failure() is None
        t = time.monotonic()
        assert pool.call("fail", [30, 30]) == [{"error": "ValueError: boom"}]  # no wait for a second line
        assert time.monotonic() - t < 10
        (pid,) = pool.call("pid", [30])
        pool.close()
        stopped = _gone(pid)
        if not stopped:
            os.kill(pid, signal.SIGKILL)
        assert stopped, "close left an idle worker running"
    finally:
        pool.close()
    with pytest.raises(WorkerStartError, match="did not start"):
        Pool("notready", 30).call("x", [5])


# a worker that dies with the thread that started it, as bwrap --die-with-parent makes it (PR_SET_PDEATHSIG: the
# signal fires when the *thread* that forked the process exits, not the process)
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL); "
                    "os.execv(sys.argv[1], sys.argv[1:])")


def _alive(pid):
    from envs.workers import proc_stat

    time.sleep(0.3)  # (a parent-death signal is delivered as the thread exits; give it time to land)
    st = proc_stat(pid)
    return st is not None and st[0] != "Z"


def test_workers_started_from_threads_that_end_live_on_for_the_next_call(tmp_path, monkeypatch):
    """Workers that verify threads started (verify_all's threads end with each call) and that die with their parent
    live on and serve the next call: before, each worker was killed as the thread that started it ended, and every
    RL step started its verifier workers again (2 s a worker for RLVE-Gym's, which import torch: a tiny RLVE step
    verified 64 answers in 4.1 s instead of 0.1)."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from envs.workers import Pool

    (tmp_path / "toyworker2.py").write_text(_WORKER_MODULE_2)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = Pool("toyworker2", 60, wrap=lambda: [sys.executable, "-c", _DIE_WITH_PARENT])
    try:
        rounds = []
        for _ in range(2):
            with ThreadPoolExecutor(2) as ex:  # (its threads end when the block does)
                rounds.append(set(ex.map(lambda _: pool.call("pid", [30])[0], range(4))))
            assert all(_alive(pid) for pid in rounds[-1]), "a worker died with the thread that started it"
        assert pool.wrapped and rounds[1] <= rounds[0]  # the second call's answers came from the first's workers
    finally:
        pool.close()


def test_verify_all_in_threads_reuses_its_workers_across_calls():
    """The same through the verifiers' own pool (confined by bwrap where installed): a second ``verify_all`` on two
    threads is scored by the workers the first one started, alive after its threads ended."""
    from envs.base import verify_all

    env = get_env("tests.test_isolated:Chatty")
    items = [(env, env.generate(s, 0), "ok") for s in range(6)]
    _POOL.close()  # (idle workers of the tests before, some of which those tests killed)
    idle = []
    for _ in range(2):
        assert all(s.correct for s in verify_all(items, workers=2))
        idle.append({w.proc.pid for w in _POOL._idle})  # (bwrap's pids: a confined worker's own is its namespace's)
        assert all(_alive(pid) for pid in idle[-1]), "a worker died with the verify thread that started it"
    assert idle[0] and idle[1] == idle[0]  # no worker lost, none started
