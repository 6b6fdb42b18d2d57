"""Superfusion: the reference late-fusion image+text model, its data and trainer.

The proving ground of sfmonitor: ``configs/trap.yaml`` reproduces the field report's fp16
attention overflow from real mechanisms; ``configs/stable.yaml`` has the fixes on.
"""
from .model import ModelConfig, Superfusion, build_model

__all__ = ["ModelConfig", "Superfusion", "build_model"]
