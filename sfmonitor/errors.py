"""The errors sfmonitor raises. Imports nothing, so every module (and the config schema) can use them."""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "NonFiniteError", "SFMonitorError", "StopTraining"]


class SFMonitorError(Exception):
    """Base class of the errors sfmonitor raises."""


class ConfigError(SFMonitorError, ValueError):
    """A configuration key is unknown or its value is out of range; the message names both."""


class NonFiniteError(SFMonitorError, FloatingPointError):
    """Raised in strict mode when a loss or gradient is non-finite (the report's assertions).
    ``event`` is the ``Event`` that recorded it."""

    def __init__(self, message: str, event: Any = None):
        super().__init__(message)
        self.event = event


class StopTraining(SFMonitorError, RuntimeError):
    """Raised by the ``stop`` action once the rescue budget is spent. ``event`` is the ``Event``
    that recorded it; ``facts`` what the stop action did (its checkpoint)."""

    def __init__(self, message: str, event: Any = None, facts: dict[str, Any] | None = None):
        super().__init__(message)
        self.event = event
        self.facts = facts or {}


class CheckpointError(SFMonitorError, RuntimeError):
    """A checkpoint cannot be written or read (missing, truncated, not a torch file, not a dict),
    or holds something that is not plain data. The message names the file and what is wrong."""


__all__ += ["CheckpointError"]
