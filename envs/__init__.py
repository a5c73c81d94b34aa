"""Cascade environments: procedurally generated, verifiable problems. Imports without torch."""
from envs.base import (  # noqa: F401
    Environment, Problem, Score, UnknownEnvironmentError, get_env, last_boxed, list_envs,
    register, strip_think, verify_all, verify_workers,
)
