"""Imports every module under ``envs`` so that their ``@register`` decorators run.

New built-in environments need no edit here: a module anywhere under ``envs/`` that registers
environments is found. Third-party environments use the ``cascade.envs`` entry-point group.
"""
import importlib
import pkgutil

import envs

_SKIP = {"envs.base", "envs.builtin", "envs.cli"}


def _import_all() -> None:
    for info in pkgutil.walk_packages(envs.__path__, "envs."):
        if info.name in _SKIP or info.name.rsplit(".", 1)[-1] in ("cli", "__main__"):
            continue
        importlib.import_module(info.name)


_import_all()
