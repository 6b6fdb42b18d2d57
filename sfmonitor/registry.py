"""The component tables: event kinds, actions and detectors are registered here, not listed.

Everything that used to be a hand-kept list derives from these three tables:

- ``KINDS``: every event kind, with its default escalation ladder (``policy.PolicyConfig`` builds
  its default ladders from it and validates ``policy.ladders`` keys against it).
- ``ACTIONS``: every action, with its function, its place in a step's order, whether it spends the
  rescue budget, its default cooldown and its config section (``actions.<name>``).
- ``DETECTORS``: every detector class, with its config section (``detectors.<name>``) and the
  kinds it reports; ``state_dict`` keys detector state by this name.

Built-in components register themselves where they are defined (``events.py`` the core's non-finite
kinds, ``detectors.py``, ``actions.py``, ``watch.py``). A user's own component registers the same
way before the ``MonitorConfig`` that configures it is built (see docs/design.md for a worked
example)::

    @sfmonitor.register_detector("loss_floor", kinds={"loss_floor": [(1, ["lr_drop"])]})
    class LossFloor(sfmonitor.Detector): ...

This module imports only the errors and the config schema, so every component can import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .schema import Section

__all__ = [
    "ACTIONS",
    "DETECTORS",
    "KINDS",
    "ActionSpec",
    "DetectorSpec",
    "KindSpec",
    "RungSpec",
    "action_names",
    "action_order",
    "event_kinds",
    "register_action",
    "register_detector",
    "register_kind",
]

RungSpec = tuple[int, Sequence[str]]  # (after, actions): reached when the streak holds >= after


@dataclass(frozen=True)
class KindSpec:
    """An event kind and its default escalation ladder.

    rungs: ``(after, [actions])`` pairs with increasing ``after``; empty: the kind is recorded,
    never acted on. window: occurrences at most this many steps apart form one streak (1:
    consecutive steps; 0: any distance).
    """

    name: str
    rungs: tuple[tuple[int, tuple[str, ...]], ...] = ()
    window: int = 0
    doc: str = ""


@dataclass(frozen=True)
class ActionSpec:
    """An action: the only kind of code that changes training.

    fn(ctx, decision) -> dict of JSON-able facts for the event. order: place among one step's
    decisions (lower first). budgeted: deciding it spends one rescue of the policy's budget.
    cooldown: default steps before it may be taken again. per_finding: decided once per finding
    (each imbalanced pair is reweighted) instead of once per step. config: its section under
    ``actions.<name>`` (None: it has no settings).
    """

    name: str
    fn: Callable[..., dict[str, Any]]
    order: float
    budgeted: bool = False
    cooldown: int = 0
    per_finding: bool = False
    config: type[Section] | None = None
    doc: str = ""


@dataclass(frozen=True)
class DetectorSpec:
    """A detector class, its config section (``detectors.<name>``) and the kinds it reports."""

    name: str
    cls: type
    config: type[Section] | None = None
    kinds: tuple[str, ...] = field(default=())


KINDS: dict[str, KindSpec] = {}
ACTIONS: dict[str, ActionSpec] = {}
DETECTORS: dict[str, DetectorSpec] = {}


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"{what} name must be an identifier (letters, digits, _), got {name!r}")
    return name


def register_kind(
    name: str, rungs: Iterable[RungSpec] = (), window: int = 0, doc: str = "", *, replace: bool = False
) -> KindSpec:
    """Register an event kind and its default ladder. Registering the same spec twice is a
    no-op; a different spec under a taken name needs ``replace=True``."""
    _check_name(name, "event kind")
    spec = KindSpec(name, tuple((int(a), tuple(acts)) for a, acts in rungs), int(window), doc)
    old = KINDS.get(name)
    if old is not None and old != spec and not replace:
        raise ConfigError(
            f"event kind {name!r} is already registered with another ladder; pass replace=True to change it"
        )
    KINDS[name] = spec
    return spec


def register_action(
    name: str,
    fn: Callable[..., dict[str, Any]] | None = None,
    *,
    order: float,
    budgeted: bool = False,
    cooldown: int = 0,
    per_finding: bool = False,
    config: type[Section] | None = None,
    doc: str = "",
    replace: bool = False,
) -> Any:
    """Register an action; usable as a decorator (``@register_action("x", order=...)``)."""
    _check_name(name, "action")

    def add(f: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        if not callable(f):
            raise ConfigError(f"action {name!r}: expected a function (ctx, decision) -> dict, got {f!r}")
        if config is not None and not (isinstance(config, type) and issubclass(config, Section)):
            raise ConfigError(f"action {name!r}: config must be a sfmonitor Section subclass, got {config!r}")
        if cooldown < 0:
            raise ConfigError(f"action {name!r}: cooldown {cooldown} is out of range; allowed: [0, inf]")
        old = ACTIONS.get(name)
        if old is not None and old.fn is not f and not replace:
            raise ConfigError(f"action {name!r} is already registered; pass replace=True to change it")
        ACTIONS[name] = ActionSpec(
            name,
            f,
            float(order),
            bool(budgeted),
            int(cooldown),
            bool(per_finding),
            config,
            doc or (f.__doc__ or "").strip().split("\n")[0],
        )
        return f

    return add(fn) if fn is not None else add


def register_detector(
    name: str,
    cls: type | None = None,
    *,
    config: type[Section] | None = None,
    kinds: Mapping[str, Iterable[RungSpec]] | Iterable[str] = (),
    window: int = 0,
    replace: bool = False,
) -> Any:
    """Register a detector class under ``name`` (its config section ``detectors.<name>`` and its
    key in ``Monitor.state_dict()['detectors']``); usable as a decorator.

    kinds: the event kinds it reports, as a mapping kind -> default ladder rungs (registered with
    ``register_kind``), or a list of kinds registered elsewhere. The class is built as
    ``cls(config_section)`` (``cls()`` when it has no config) when its section is enabled.
    """
    _check_name(name, "detector")

    def add(c: type) -> type:
        if config is not None and not (isinstance(config, type) and issubclass(config, Section)):
            raise ConfigError(f"detector {name!r}: config must be a sfmonitor Section subclass, got {config!r}")
        old = DETECTORS.get(name)
        if old is not None and old.cls is not c and not replace:
            raise ConfigError(f"detector {name!r} is already registered; pass replace=True to change it")
        names = []
        if isinstance(kinds, Mapping):
            for kind, rungs in kinds.items():
                register_kind(kind, rungs, window, replace=replace)
                names.append(kind)
        else:
            for kind in kinds:
                if kind not in KINDS:
                    register_kind(kind)
                names.append(kind)
        DETECTORS[name] = DetectorSpec(name, c, config, tuple(names))
        if not getattr(c, "name", ""):
            setattr(c, "name", name)  # noqa: B010 - any class may be registered, not only Detector
        return c

    return add(cls) if cls is not None else add


def event_kinds() -> tuple[str, ...]:
    return tuple(KINDS)


def action_names() -> tuple[str, ...]:
    return tuple(ACTIONS)


def action_order() -> tuple[str, ...]:
    """Action names in the order one step's decisions are carried out."""
    return tuple(sorted(ACTIONS, key=lambda n: ACTIONS[n].order))


def require_action(name: str, key: str) -> None:
    """ConfigError naming ``key`` unless ``name`` is a registered action."""
    if name not in ACTIONS:
        raise ConfigError(f"{key}: unknown action {name!r}; allowed: {', '.join(ACTIONS)}")


def require_kind(name: str, key: str) -> None:
    """ConfigError naming ``key`` unless ``name`` is a registered event kind."""
    if name not in KINDS:
        raise ConfigError(f"{key}: unknown event kind {name!r}; allowed: {', '.join(KINDS)}")
