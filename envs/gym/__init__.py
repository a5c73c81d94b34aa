"""RLVE-Gym: procedurally generated, verifiable environments registered under ``gym/<name>``.

One module per family; shared parsing and the :class:`~envs.gym._util.GymEnv` base live in
``_util``. Importing this package registers every gym environment (``envs.builtin`` also
imports each module on its own). New environments go in the module of their family, or in a new
module listed in ``FAMILIES``; they use the one registry of :mod:`envs.base`.
"""
import importlib

FAMILIES = ("arithmetic", "number_theory", "combinatorics", "sorting_searching", "graphs",
            "dynamic_programming", "logic_puzzles", "strings", "geometry", "probability")

for _m in FAMILIES:
    importlib.import_module(f"{__name__}.{_m}")


def gym_env_ids() -> list[str]:
    """Ids of all registered gym environments, sorted."""
    from envs.base import list_envs

    return [e for e in list_envs() if e.startswith("gym/")]
