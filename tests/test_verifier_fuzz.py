"""Property tests: every registered verifier, fed empty, random, unicode and 1 MB strings, returns a
valid zero-credit Score within its time bound and never raises.

For an environment whose answers are read from a marker (``\\boxed{}``), text without a marker
earns nothing (not correct, reward <= 0) and random text inside a marker is not correct. An
environment marked ``free_form`` (instruction following: any text may legitimately satisfy an
instruction such as "no commas") must give valid bounded scores and zero credit to an empty
response.
"""
from __future__ import annotations

import functools
import time

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from envs import Score, get_env, list_envs

ENV_IDS = list_envs()
MB = 1_000_000
BIG = ("a1 \u00e9\u4e2d\U0001f600{}" * (MB // 10))[:MB]

SETTINGS = settings(max_examples=4, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@functools.lru_cache(maxsize=None)
def _env_and_problem(env_id: str):
    env = get_env(env_id)
    return env, env.generate(0, 0)


def _verify(env, problem, text: str) -> Score:
    t = time.perf_counter()
    s = env.verify(problem, text)
    dt = time.perf_counter() - t
    assert isinstance(s, Score)
    assert -1.0 <= s.reward <= 1.0
    assert dt <= env.verify_time_limit, f"verify took {dt:.2f}s > {env.verify_time_limit}s"
    return s


def _unmarked(env, problem, text: str) -> None:
    s = _verify(env, problem, text)
    if not text.strip():
        assert not s.correct and s.reward <= 0, s
    elif not getattr(env, "free_form", False):
        assert not s.correct and s.reward <= 0, s


def _marked(env, problem, text: str) -> None:
    answer = env.format_answer(problem.answer).strip()
    assume(text.strip() != answer)
    s = _verify(env, problem, f"\\boxed{{{text}}}")
    if not getattr(env, "free_form", False):
        assert not s.correct, s


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_random_text_earns_nothing(env_id):
    env, problem = _env_and_problem(env_id)

    @SETTINGS
    @given(st.one_of(st.text(max_size=200), st.text(st.characters(min_codepoint=0x80), max_size=200),
                     st.binary(max_size=100).map(lambda b: b.decode("latin-1"))))
    @example("")
    @example(" \n\t")
    @example("\x00\ud800\uffff")
    @example(BIG)
    @example("\n" * MB)
    def prop(text):
        _unmarked(env, problem, text)

    prop()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_random_boxed_answers_are_not_correct(env_id):
    env, problem = _env_and_problem(env_id)

    @SETTINGS
    # no digits and at least 6 characters: many answers are numbers, and some scorers rightly read
    # a number's value ("0" is "0 days"), so short numerals may be correct by chance
    @given(st.text(alphabet=st.characters(blacklist_characters="{}0123456789", blacklist_categories=("Nd",)),
                   min_size=6, max_size=60))
    @example("qx9 zz")
    @example(BIG.replace("{", "").replace("}", ""))
    def prop(text):
        _marked(env, problem, text)

    prop()
