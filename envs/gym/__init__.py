"""RLVE-Gym: procedurally generated, verifiable environments registered under ``gym/<name>``.

One module per family (arithmetic, number_theory, combinatorics, sorting_searching, graphs,
dynamic_programming, logic_puzzles, strings, geometry, probability); shared parsing and the
:class:`~envs.gym._util.GymEnv` base live in ``_util``. Importing this package registers them all.
"""
import importlib

FAMILIES = ("arithmetic", "number_theory", "combinatorics", "sorting_searching", "graphs",
            "dynamic_programming", "logic_puzzles", "strings", "geometry", "probability")

for _m in FAMILIES:
    try:
        importlib.import_module(f"envs.gym.{_m}")
    except ModuleNotFoundError as _e:  # a family module not written yet
        if _e.name != f"envs.gym.{_m}":
            raise
