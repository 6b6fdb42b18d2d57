"""Sinks: where statistics and events go. See ``base.Sink`` for the interface.

Backends are named here and imported only when a run asks for them, so ``import sfmonitor``
imports neither wandb nor tensorboard.
"""

from .base import SINK_METHODS, DuckSink, MemorySink, Sink, SinkRouter, make_sink

# name -> "relative module:class"; adding a sink is one file plus one line here.
SINKS = {
    "jsonl": ".jsonl:JsonlSink",
    "console": ".console:ConsoleSink",
    "tensorboard": ".tensorboard:TensorBoardSink",
    "wandb": ".wandb:WandbSink",
}

__all__ = ["SINKS", "SINK_METHODS", "DuckSink", "MemorySink", "Sink", "SinkRouter", "make_sink"]
