"""The config schema of the reference model: ``Config`` (a validated dataclass) and ``option``.

``option(default, doc, lo=, hi=, lo_open=, choices=)`` declares a field with its one-line doc and
allowed range; ``Config.__post_init__`` checks every field's type and range, then calls
``validate()`` for cross-field checks. ``Config.from_dict(data, prefix="model.")`` rejects unknown
keys. Every failure raises ``ConfigError`` (a ``ValueError``) naming the full key (``model.d_model``)
and what is allowed.

The reference model keeps its own schema so that importing it loads nothing of sfmonitor.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Config", "ConfigError", "option"]

_C = TypeVar("_C", bound="Config")


class ConfigError(ValueError):
    """A reference config key is unknown or its value is out of range; the message names both."""


def option(
    default: Any,
    doc: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    choices: tuple | None = None,
) -> Any:
    """A config field: default, one-line doc, optional numeric range [lo, hi] (or (lo, hi]) or
    choices. Mutable defaults (lists, dicts, configs) are copied per instance."""
    meta = {"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to floats)."""
    if isinstance(tp, type) and issubclass(tp, Config):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return tp.from_dict(value, prefix=key + ".")
    if typing.get_origin(tp) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        args = typing.get_args(tp)
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _check_range(value: Any, meta: Any, key: str) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}")
    lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open")
    if (lo is None and hi is None) or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{key}: NaN is not allowed")
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ConfigError(f"{key}: {value!r} is out of range; allowed: {rng}")


@dataclass
class Config:
    """Base of the reference configs: checks types and ranges in ``__post_init__``."""

    _prefix: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                continue
            key = self._prefix + f.name
            value = _coerce(getattr(self, f.name), hints[f.name], key)
            object.__setattr__(self, f.name, value)
            _check_range(value, f.metadata, key)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise ConfigError naming the keys. Override where needed."""

    @classmethod
    def keys(cls) -> list[str]:
        return sorted(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any] | None, prefix: str = "") -> _C:
        """Build from a dict; unknown keys raise ConfigError naming the key and the allowed ones.
        ``prefix`` (``"model."``) goes in front of every key in the error messages."""
        data = dict(data or {})
        names = cls.keys()
        unknown = sorted(set(data) - set(names), key=str)
        if unknown:
            under = f" under {prefix.rstrip('.')}" if prefix else ""
            raise ConfigError(f"unknown config key {prefix}{unknown[0]!s}; allowed keys{under}: {', '.join(names)}")
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_prefix", prefix)  # kept for the messages of __post_init__
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.name in data:
                value = data[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                # option() gives every field a default or a default_factory
                assert f.default_factory is not dataclasses.MISSING, f"{prefix}{f.name} has no default"
                value = f.default_factory()
            object.__setattr__(obj, f.name, value)
        obj.__post_init__()
        return obj

    def to_dict(self) -> dict[str, Any]:
        """Plain data (nested configs as dicts): YAML/JSON-able, and ``from_dict`` takes it back."""

        def plain(v: Any) -> Any:
            if isinstance(v, Config):
                return v.to_dict()
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            return v

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self) if not f.name.startswith("_")}
