"""The whole configuration, assembled: ``MonitorConfig`` holds one section per component.

Each component declares its own section next to its code (``stats.StatsConfig``,
``detectors.DetectorsConfig``, ``policy.PolicyConfig``, ``actions.ActionsConfig``,
``watch.WatchConfig``, ``forensics.BundleConfig``) with ``schema.Section``/``schema.option``.
This module imports them; nothing in the package imports it back except the monitor.
``MonitorConfig.from_any`` accepts a MonitorConfig, a dict, a YAML path or None.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from .actions import ActionsConfig
from .detectors import DetectorsConfig
from .errors import ConfigError
from .forensics import BundleConfig
from .policy import PolicyConfig
from .schema import Section, option
from .schema import describe as _describe
from .stats import StatsConfig
from .watch import WatchConfig

__all__ = ["ConfigError", "MonitorConfig", "Section", "StatsConfig", "describe", "option"]


@dataclass
class MonitorConfig(Section):
    """The whole monitor configuration. Load with ``MonitorConfig.from_any(dict | path | None)``."""

    strict: bool = option(
        False,
        "raise NonFiniteError on a non-finite loss or gradient instead of skipping the step (the report's assertions)",
    )
    console: bool = option(True, "print one line per event to stderr")
    distributed: bool = option(
        True,
        "under an initialised process group, agree with the other ranks every step (attach on every "
        "rank); false: this monitor is this process's alone (a model only this rank trains): no "
        "collective, it writes its own files",
    )
    dry_run: bool = option(
        False,
        "detectors and policy run and events say what would have been done, but nothing changes "
        "training (no skip, no clip, no LR change): how to learn to trust the monitor on a new model",
    )
    log_every: int = option(1, "send metrics to the sinks every N optimizer steps (events: always)", lo=1)
    max_events: int = option(
        10_000, "events kept in monitor.events (the oldest go first); events.jsonl keeps every one", lo=1
    )
    stats: StatsConfig = option(StatsConfig, "statistics stage")
    detectors: DetectorsConfig = option(DetectorsConfig, "detectors stage (docs/policy.md)")
    policy: PolicyConfig = option(PolicyConfig, "findings -> actions: ladders, cooldowns, budget")
    actions: ActionsConfig = option(ActionsConfig, "settings of each rescue action")
    watch: WatchConfig = option(WatchConfig, "fp16 activation overflow watch (docs/forensics.md)")
    bundle: BundleConfig = option(BundleConfig, "anomaly bundles for `sfmonitor replay`")

    @classmethod
    def from_any(cls, config: MonitorConfig | dict | str | os.PathLike | None) -> MonitorConfig:
        if config is None:
            return cls()
        if isinstance(config, MonitorConfig):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if not os.path.exists(path):
                raise ConfigError(f"config file {path!r} does not exist")
            if os.path.isdir(path):
                raise ConfigError(f"config file {path!r} is a folder, not a YAML file")
            try:
                with open(path, "rb") as fh:
                    text = fh.read().decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"config file {path!r} is not a UTF-8 text file (a binary file?): {e}") from e
            except OSError as e:
                raise ConfigError(f"config file {path!r} cannot be read: {e}") from e
            from .schema import load_yaml

            data = load_yaml(text, path)
            if data is None:
                data = {}
            if not isinstance(data, dict):
                raise ConfigError(f"config file {path!r} must hold a mapping, got {type(data).__name__}")
            if "monitor" in data and isinstance(data["monitor"], dict) and len(data) == 1:
                data = data["monitor"]
            return cls.from_dict(data)
        raise ConfigError(f"config must be a MonitorConfig, a dict, a YAML path or None; got {type(config).__name__}")


def describe(section: type[Section] = MonitorConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every field, recursively; ``reference()`` writes them as a page."""
    return _describe(section, prefix)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # (a table cell)


def reference() -> str:
    """docs/config.md: every config key with its default and its doc, one table per section
    (``tests/test_config.py`` checks the page is this text; regenerate it with
    ``python -c "import sfmonitor.config as c; print(c.reference(), end='')" > docs/config.md``)."""

    def shown(v: Any) -> str:
        if isinstance(v, dict) and v and all(isinstance(x, Section) for x in v.values()):
            return "every event kind's default ladder ([Policy](policy.md))"
        text = json.dumps(v) if isinstance(v, (list, dict, type(None), bool)) else repr(v)
        return "`" + _cell(text) + "`"

    out = [
        "# Configuration reference",
        "",
        "Every key `Monitor(config=...)` takes (a `MonitorConfig`, a dict, or a YAML file of the same",
        "shape), with its default and what it does. Unknown keys and values out of range raise",
        "`sfmonitor.ConfigError` naming the key and the allowed range. Detectors and actions registered",
        "by your code add their own sections (`detectors.<name>`, `actions.<name>`). This page is",
        "generated from the code (`sfmonitor.config.reference()`).",
    ]
    section = None
    for key, default, doc in describe():
        head = key.rsplit(".", 1)[0] if "." in key else "top level"
        if head != section:
            section = head
            out += ["", f"## `{head}`" if head != "top level" else "## Top level", ""]
            out += ["| key | default | meaning |", "|---|---|---|"]
        out.append(f"| `{key}` | {shown(default)} | {_cell(doc).replace('<', '&lt;')} |")
    return "\n".join(out) + "\n"
