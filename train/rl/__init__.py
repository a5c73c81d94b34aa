"""The RL core: advantage estimators, policy losses, reward shaping and batch filters.

Everything here is a pure function of tensors (or plain Python data), selected by name from a
:class:`Registry`:

- ``ADVANTAGES`` / :func:`get_advantage`: ``grpo``, ``drgrpo``, ``maxrl``, ``rloo``
  (see :mod:`train.rl.advantages`);
- ``LOSSES`` / :func:`get_loss`: ``ppo``/``grpo``, ``drgrpo``, ``dapo``, ``gspo``, ``cispo``,
  ``dppo_tv`` (see :mod:`train.rl.losses`);
- :mod:`train.rl.shaping`: DAPO dynamic sampling, the ZAYA1 length reward, the LZ77 repetition
  gate and overlong handling.
"""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions. ``@REG.register("a", "b")`` adds a function under aliases;
    ``REG.get(name)`` returns it or raises a ``KeyError`` naming the valid choices."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for name in names:
                if name in self._items and self._items[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._items[name] = fn
            return fn
        return deco

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


# Submodules import Registry from this package, so they are imported after it is defined.
from train.rl.advantages import ADVANTAGES, compute_advantages, get_advantage  # noqa: E402
from train.rl.losses import LOSSES, LossConfig, aggregate, get_loss  # noqa: E402

__all__ = [
    "Registry", "ADVANTAGES", "get_advantage", "compute_advantages",
    "LOSSES", "LossConfig", "get_loss", "aggregate",
]
