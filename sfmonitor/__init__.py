"""sfmonitor: keep PyTorch training runs alive.

    monitor = sfmonitor.attach(model, optimizer, scaler=scaler)
    loss = monitor.combine({"vision": l_v, "text": l_t, "fusion": l_f},
                           weights={"vision": 0.4, "text": 0.3, "fusion": 0.3})

docs/design.md describes the pipeline and how to add a detector, an action or a sink. Importing
this package imports neither wandb nor tensorboard.
"""

from .config import MonitorConfig
from .detectors import Detector
from .events import ConfigError, Decision, Event, Finding, NonFiniteError, StopTraining
from .monitor import Monitor, attach
from .registry import register_action, register_detector, register_kind

__version__ = "0.1.0"


def lr_find(*args, **kwargs):
    """LR range test; see ``sfmonitor.tools.lr_find.lr_find``."""
    from .tools.lr_find import lr_find as _lr_find

    return _lr_find(*args, **kwargs)


__all__ = [
    "ConfigError",
    "Decision",
    "Detector",
    "Event",
    "Finding",
    "Monitor",
    "MonitorConfig",
    "NonFiniteError",
    "StopTraining",
    "__version__",
    "attach",
    "lr_find",
    "register_action",
    "register_detector",
    "register_kind",
]
