"""Superfusion: the reference late-fusion image+text model, its data and trainer.

The proving ground of sfmonitor: ``configs/trap.yaml`` reproduces the field report's fp16
attention overflow from real mechanisms; ``configs/stable.yaml`` has the fixes on.

The model and the data import nothing of sfmonitor; the trainer attaches it. The package registers
``sfmonitor train``, ``sfmonitor lr-find`` and its replay factory through entry points
(pyproject.toml).
"""

from ._schema import ConfigError
from .model import ModelConfig, Superfusion, build_model

__all__ = ["ConfigError", "ModelConfig", "Superfusion", "build_model"]
