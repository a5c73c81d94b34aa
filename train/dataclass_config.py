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


def build(cls, data: dict | None, where: str = "", base=None):
    """``cls(**data)`` with nested dataclasses built recursively and every value type-checked.

    A mapping given for a dataclass-typed field merges into that field's default (its ``default_factory``'s
    instance, e.g. an optimizer configured with its own learning rate and warm-up), recursively: the keys it
    does not set keep that default's values, not the plain dataclass's. ``base``, an instance of ``cls``,
    gives the values of the fields ``data`` does not set."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        at = f" in {where}" if where else ""
        raise ConfigError(f"unknown key {'.'.join(filter(None, [where, unknown[0]]))!r}{at}; "
                          f"valid keys: {', '.join(sorted(fields))}")
    kw = {}
    for k, v in data.items():
        tp, at = hints[k], ".".join(filter(None, [where, k]))
        sub = _default(fields[k], tp, base) if isinstance(v, dict) else None
        kw[k] = build(tp, v, at, sub) if sub is not None else _check(tp, v, at)
    if base is not None:
        kw.update({k: getattr(base, k) for k in fields if k not in kw})
    try:
        return cls(**kw)
    except (ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"{where or cls.__name__}: {msg}") from None


def _default(f: dataclasses.Field, tp, base=None):
    """The default of field ``f`` where its type ``tp`` is a dataclass: ``base``'s value where given, else its
    ``default_factory``'s instance; None for any other field."""
    if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return None
    if base is not None:
        v = getattr(base, f.name)
    else:
        v = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    return v if isinstance(v, tp) else None


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)
