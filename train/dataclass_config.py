"""Typed configs: build nested dataclasses from plain dicts (YAML, overrides), strictly.

An unknown key names the valid keys at that level; a value of the wrong type names the key,
the expected type and the value.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union


class ConfigError(ValueError):
    pass


def _check(tp, v, where: str):
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        return v
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check(a, v, where)
            except ConfigError as e:
                errors.append((a, e))
        # the error of the option of the value's own kind (a mapping's, for a mapping given to list | dict)
        kind = [e for a, e in errors if _container(a) is not None and isinstance(v, _container(a))]
        raise (kind or [e for _, e in errors] or [ConfigError(f"{where}: unexpected value {v!r}")])[0]
    if dataclasses.is_dataclass(tp):
        if isinstance(v, tp):
            return v
        if not isinstance(v, dict):
            raise ConfigError(f"{where}: expected a mapping, got {v!r}")
        return build(tp, v, where)
    if origin in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(v).__name__} {v!r}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        vals = [_check(item, x, f"{where}[{i}]") for i, x in enumerate(v)]
        return tuple(vals) if origin is tuple else vals
    if origin is dict:
        if not isinstance(v, dict):
            raise ConfigError(f"{where}: expected a mapping, got {v!r}")
        args = typing.get_args(tp)
        val = args[1] if len(args) == 2 else Any
        return {k: _check(val, x, f"{where}.{k}") for k, x in v.items()}
    if tp is bool:
        if isinstance(v, bool):
            return v
        raise ConfigError(f"{where}: expected true/false, got {v!r}")
    if tp is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(v)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {v!r}")
    if tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise ConfigError(f"{where}: expected an integer, got {v!r}")
    if tp is str:
        if isinstance(v, str):
            return v
        # a YAML number in a file (out: 2024); the command line gives a str setting its text as written
        # (cascade.config.parse_overrides)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return str(v)
        raise ConfigError(f"{where}: expected a string, got {v!r}")
    return v


def _container(tp):
    """The Python type a value of ``tp`` arrives as when ``tp`` is a container (dict or list), else None."""
    origin = typing.get_origin(tp)
    if origin is dict or dataclasses.is_dataclass(tp):
        return dict
    if origin in (list, tuple):
        return (list, tuple)
    return None


def build(cls, data: dict | None, where: str = ""):
    """``cls(**data)`` with nested dataclasses built recursively and every value type-checked."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        at = f" in {where}" if where else ""
        raise ConfigError(f"unknown key {'.'.join(filter(None, [where, unknown[0]]))!r}{at}; "
                          f"valid keys: {', '.join(sorted(fields))}")
    kw = {k: _check(hints[k], v, ".".join(filter(None, [where, k]))) for k, v in data.items()}
    try:
        return cls(**kw)
    except (ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"{where or cls.__name__}: {msg}") from None


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)
