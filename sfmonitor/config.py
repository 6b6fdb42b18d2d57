"""Configuration: one small keyword-only dataclass per component, loadable from a dict or YAML.

Every field carries a one-line doc and, where it has one, its allowed range. Unknown keys, wrong
types and out-of-range values raise ``ConfigError`` naming the full key (``detectors.loss_spike.z``)
and what is allowed. ``MonitorConfig.from_any`` accepts a MonitorConfig, a dict, a YAML path or None.

To add a setting: add a field with ``option(default, "doc", lo=..., hi=...)`` to the section of the
component that reads it. To add a section: subclass ``Section`` and add it to ``MonitorConfig``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from .events import ConfigError

__all__ = ["ConfigError", "Section", "option", "MonitorConfig", "StatsConfig"]


def option(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, choices: tuple | None = None) -> Any:
    """A config field: default, one-line doc, optional numeric range [lo, hi] or choices.

    Mutable defaults (lists, dicts, sections) are copied per instance.
    """
    meta = {"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        import copy
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: expected {' or '.join(_describe(a) for a in args)}, got {value!r}")
    if isinstance(tp, type) and issubclass(tp, Section):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return tp.from_dict(value, prefix=key + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


@dataclass
class Section:
    """Base of every config section: validates types and ranges in ``__post_init__``."""

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
    def from_dict(cls, data: dict[str, Any] | None, prefix: str = "") -> "Section":
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown config key {prefix}{unknown[0]!s}; "
                              f"allowed keys{' under ' + prefix.rstrip('.') if prefix else ''}: "
                              f"{', '.join(sorted(names))}")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for k, v in data.items():
            tp = hints[k]
            kwargs[k] = _coerce(v, tp, prefix + k)
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_prefix", prefix)
        # Re-run __init__ with the prefix kept for error messages.
        init_fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        for name, f in init_fields.items():
            if name in kwargs:
                val = kwargs[name]
            elif f.default is not dataclasses.MISSING:
                val = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                val = f.default_factory()  # type: ignore[misc]
            else:
                raise ConfigError(f"missing config key {prefix}{name}")
            object.__setattr__(obj, name, val)
        obj.__post_init__()
        return obj

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                continue
            out[f.name] = _plain(getattr(self, f.name))
        return out


def _plain(v: Any) -> Any:
    """Sections, and Sections inside lists and dicts, as plain data (YAML/JSON-able)."""
    if isinstance(v, Section):
        return v.to_dict()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _check_range(value: Any, meta: Any, key: str) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}")
    lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open")
    if (lo is None and hi is None) or value is None or isinstance(value, bool):
        return
    if not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{key}: NaN is not allowed")
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi)
    if bad:
        left = "(" if lo_open else "["
        rng = f"{left}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ConfigError(f"{key}: {value!r} is out of range; allowed: {rng}")


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------

@dataclass
class StatsConfig(Section):
    """What the statistics stage measures each optimizer step."""

    update_ratio_every: int = option(1, "compute update_ratio/<group> every N optimizer steps "
                                        "(0: never); costs one fp32 copy of the parameters on those steps", lo=0)
    grad_ratio_every: int = option(100, "compute grad_ratio/<a>/<b> and grad_cos/<a>/<b> on shared "
                                       "parameters every N optimizer steps (0: never); costs one extra "
                                       "backward per loss component on the first micro-batch of those steps", lo=0)
    loss_ratio_pairs: list[list[str]] = option([], "pairs [a, b] for loss_ratio/<a>/<b> and grad_ratio; "
                                                   "empty: every pair of components in combine() order")
    grad_ratio_groups: list[str] = option([], "groups whose parameters count as shared for grad_ratio; "
                                              "empty: every parameter that receives gradient from both components")

    def validate(self) -> None:
        for i, pair in enumerate(self.loss_ratio_pairs):
            if len(pair) != 2 or pair[0] == pair[1]:
                raise ConfigError(f"{self._prefix}loss_ratio_pairs[{i}]: expected two different "
                                  f"component names, got {pair!r}")


# Component sections live beside the code that reads them (detectors.py, policy.py, actions.py,
# watch.py, forensics.py); those modules import Section/option from here, which is defined above.
from .actions import ActionsConfig  # noqa: E402
from .detectors import DetectorsConfig  # noqa: E402
from .forensics import BundleConfig  # noqa: E402
from .policy import PolicyConfig  # noqa: E402
from .watch import WatchConfig  # noqa: E402


@dataclass
class MonitorConfig(Section):
    """The whole monitor configuration. Load with ``MonitorConfig.from_any(dict | path | None)``."""

    strict: bool = option(False, "raise NonFiniteError on a non-finite loss or gradient instead of "
                                 "skipping the step (the report's assertions)")
    console: bool = option(True, "print one line per event to stderr")
    stats: StatsConfig = option(StatsConfig(), "statistics stage")
    detectors: DetectorsConfig = option(DetectorsConfig(), "detectors stage (docs/policy.md)")
    policy: PolicyConfig = option(PolicyConfig(), "findings -> actions: ladders, cooldowns, budget")
    actions: ActionsConfig = option(ActionsConfig(), "settings of each rescue action")
    watch: WatchConfig = option(WatchConfig(), "fp16 activation overflow watch (docs/forensics.md)")
    bundle: BundleConfig = option(BundleConfig(), "anomaly bundles for `sfmonitor replay`")

    @classmethod
    def from_any(cls, config: "MonitorConfig | dict | str | os.PathLike | None") -> "MonitorConfig":
        if config is None:
            return cls()
        if isinstance(config, MonitorConfig):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            import yaml
            path = os.fspath(config)
            if not os.path.exists(path):
                raise ConfigError(f"config file {path!r} does not exist")
            with open(path, encoding="utf-8") as fh:
                try:
                    data = yaml.safe_load(fh)
                except yaml.YAMLError as e:
                    raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from e
            if data is None:
                data = {}
            if not isinstance(data, dict):
                raise ConfigError(f"config file {path!r} must hold a mapping, got {type(data).__name__}")
            if "monitor" in data and isinstance(data["monitor"], dict) and len(data) == 1:
                data = data["monitor"]
            return cls.from_dict(data)
        raise ConfigError(f"config must be a MonitorConfig, a dict, a YAML path or None; "
                          f"got {type(config).__name__}")


def describe(section: type[Section] = MonitorConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every field, recursively; used by the docs table."""
    rows = []
    inst = section()
    for f in dataclasses.fields(section):
        if f.name.startswith("_"):
            continue
        v = getattr(inst, f.name)
        if isinstance(v, Section):
            rows.extend(describe(type(v), prefix + f.name + "."))
        else:
            rows.append((prefix + f.name, v, f.metadata.get("doc", "")))
    return rows
