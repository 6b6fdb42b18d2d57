"""The config schema: ``Section`` (a validated, keyword-only dataclass) and ``option`` (a field
with its one-line doc and allowed range). Every component declares its own section with these;
this module imports no component, so any module may import it.

Unknown keys, wrong types and out-of-range values raise ``ConfigError`` naming the full key
(``detectors.loss_spike.z``) and what is allowed. Float options take a number or a string that is
a decimal float literal (``"1e-6"``: YAML 1.1, which PyYAML follows, reads a float without a dot as
a string) and refuse NaN and infinities, unless the option says ``allow_inf=True`` (infinities
then pass; NaN never does) -- floats inside lists and mappings too. ``choices`` bounds a value,
or each item of a list-valued option; it may be a callable returning the allowed names when
they come from a registry.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from .errors import ConfigError

__all__ = ["ConfigError", "Section", "describe", "load_yaml", "option"]


def option(
    default: Any,
    doc: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    choices: tuple | Callable[[], Iterable] | None = None,
    allow_inf: bool = False,
) -> Any:
    """A config field: default, one-line doc, optional numeric range [lo, hi] or choices.

    ``choices``: the allowed values (of each item, for a list-valued option), or a callable
    returning them (names from a registry, read when a config is checked). ``allow_inf``: a float
    option takes +-inf (within [lo, hi]); without it every float option must be finite. NaN is
    never allowed. Mutable defaults (lists, dicts, sections) are copied per instance. A nested
    section is given as its class (``option(PolicyConfig, ...)``) and built anew for each config:
    its defaults then include what was registered after import (an action's cooldown, a
    detector's section), which a copy of an instance built at import would not.
    """
    meta = {"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices, "allow_inf": allow_inf}
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        import copy

        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# A decimal float literal, as a string: what PyYAML leaves unparsed ("1e-6", "3E+2", ".5e1").
# No "nan"/"inf" (YAML spells those .nan/.inf), no hex, no underscores.
_FLOAT_LITERAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _coerce(value: Any, tp: Any, key: str, *, allow_inf: bool = False) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to floats, float
    literals in strings parsed). Floats must be finite unless ``allow_inf``; NaN never passes."""
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
                return _coerce(value, a, key, allow_inf=allow_inf)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # one real type (X | None): its own message says what is wrong
            raise ConfigError(errors[0])
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
        return [_coerce(v, inner, f"{key}[{i}]", allow_inf=allow_inf) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, f"{key}.{k}", allow_inf=allow_inf) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_LITERAL.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer too large for a float
            raise ConfigError(f"{key}: {value} is too large for a float") from None
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise ConfigError(f"{key}: {value!r} is not allowed; this option must be a finite number")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


_S = TypeVar("_S", bound="Section")
_T = TypeVar("_T", bound="SectionTable")


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
            value = _coerce(getattr(self, f.name), hints[f.name], key, allow_inf=bool(f.metadata.get("allow_inf")))
            object.__setattr__(self, f.name, value)
            _check_range(value, f.metadata, key)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise ConfigError naming the keys. Override where needed."""

    @classmethod
    def from_dict(cls: type[_S], data: dict[str, Any] | None, prefix: str = "") -> _S:
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
        data = dict(data or {})
        fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        names = set(fields)
        unknown = sorted(set(data) - names, key=str)
        if unknown:
            raise ConfigError(
                f"unknown config key {prefix}{unknown[0]!s}; "
                f"allowed keys{' under ' + prefix.rstrip('.') if prefix else ''}: "
                f"{', '.join(sorted(names))}"
            )
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for k, v in data.items():
            tp = hints[k]
            kwargs[k] = _coerce(v, tp, prefix + k, allow_inf=bool(fields[k].metadata.get("allow_inf")))
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_prefix", prefix)
        # Re-run __init__ with the prefix kept for error messages.
        init_fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        for name, f in init_fields.items():
            if name in kwargs:
                val = kwargs[name]
            elif f.default is not dataclasses.MISSING:
                val = f.default
            elif f.default_factory is not dataclasses.MISSING:
                val = f.default_factory()
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
    if callable(choices):
        choices = tuple(choices())
    if choices is not None:
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if item not in choices:
                where = key if i is None else f"{key}[{i}]"
                raise ConfigError(f"{where}: {item!r} is not allowed; choose one of {', '.join(map(repr, choices))}")
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


def describe(section: type[Section], prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every field, recursively; used by the docs table."""
    rows: list[tuple[str, Any, str]] = []
    if issubclass(section, SectionTable):
        for name, cls in section.table().items():
            rows.extend(describe(cls, prefix + name + "."))
        return rows
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


class SectionTable(Section):
    """A section whose sub-sections come from a table of registered components (``detectors``,
    ``actions``): one sub-section per registered name, so a component registered by a user is
    configured and validated under its own name like a built-in one.

    Subclasses define ``table() -> {name: Section subclass}``. A name missing from the input gets
    its section's defaults; an unknown name is a ConfigError listing the registered ones.
    """

    def __init__(self, **sections: Any) -> None:
        object.__setattr__(self, "_prefix", "")
        object.__setattr__(self, "_sections", {})
        self._fill(sections)

    @classmethod
    def table(cls) -> dict[str, type[Section]]:
        raise NotImplementedError

    def _fill(self, given: dict[str, Any]) -> None:
        table = self.table()
        unknown = sorted(set(given) - set(table))
        if unknown:
            where = f" under {self._prefix.rstrip('.')}" if self._prefix else ""
            raise ConfigError(
                f"unknown config key {self._prefix}{unknown[0]}; allowed keys{where}: {', '.join(sorted(table))}"
            )
        for name, cls in table.items():
            value = given.get(name)
            key = f"{self._prefix}{name}"
            if value is None:
                value = cls.from_dict({}, prefix=key + ".")
            elif not isinstance(value, cls):
                value = _coerce(value, cls, key)
            self._sections[name] = value

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("_sections")
        if sections is None or name.startswith("__"):
            raise AttributeError(name)
        if name in sections:
            return sections[name]
        cls = self.table().get(name)  # registered after this config was built: its defaults
        if cls is None:
            raise AttributeError(f"{type(self).__name__} has no section {name!r}")
        sections[name] = cls.from_dict({}, prefix=f"{self._prefix}{name}.")
        return sections[name]

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._sections.items())})"

    def __deepcopy__(self, memo: dict[int, Any]) -> SectionTable:
        import copy

        new = type(self).__new__(type(self))
        object.__setattr__(new, "_prefix", self._prefix)
        object.__setattr__(new, "_sections", copy.deepcopy(self._sections, memo))
        return new

    def __post_init__(self) -> None:  # sections validate themselves when built
        pass

    @classmethod
    def from_dict(cls: type[_T], data: dict[str, Any] | None, prefix: str = "") -> _T:
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_prefix", prefix)
        object.__setattr__(obj, "_sections", {})
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
        obj._fill(dict(data or {}))
        return obj

    def to_dict(self) -> dict[str, Any]:
        for name in self.table():  # include sections registered since
            getattr(self, name)
        return {name: s.to_dict() for name, s in self._sections.items()}

    def sections(self) -> dict[str, Section]:
        """name -> section, every registered component included."""
        for name in self.table():
            getattr(self, name)
        return dict(self._sections)


def load_yaml(text: str, path: str) -> Any:
    """``yaml.safe_load`` of a config file's text (``path`` names it in errors) that refuses
    duplicate keys (ConfigError naming the key and both lines) and turns every parser failure
    (bad syntax, a 5000-digit integer, a 13th month, nesting past the recursion limit) into a
    ConfigError naming the file."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # "<<: *anchor": what follows overrides it, by design
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # unhashable: SafeLoader reports it
                        continue
                    line = key_node.start_mark.line + 1
                    if first is not None:
                        raise ConfigError(
                            f"config file {path!r}: duplicate key {key!r} at line "
                            f"{line} (first at line {first}); keep one"
                        )
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from e
    except (ValueError, OverflowError, TypeError, RecursionError) as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {type(e).__name__}: {str(e)[:300]}") from e
