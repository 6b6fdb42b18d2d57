"""Anomaly forensics: input statistics, the per-step batch recorder, anomaly bundles.

The report's playbook, automated: when NaN appears, *save the state at once*, *print per-modality
input statistics* (text mean/std, image min/max) and *disable loss components one at a time*
(``sfmonitor replay --ablate`` does the last, from a bundle written here).

* ``input_stats(args, kwargs)``: statistics of every tensor input of the model's forward, computed
  only on an anomaly, with one host read.
* ``BatchRecorder``: keeps *references* (no copies) to the root model's forward inputs of the
  current optimizer step -- every micro-batch -- and the RNG state at the step's first forward.
* ``write_bundle`` / ``load_bundle``: ``run_dir/bundles/<step>-<kind>/`` written atomically (temp dir,
  then rename), size-capped, loaded with ``torch.load(weights_only=True)`` only.

Bundle layout::

    manifest.json   format, step, kind, files kept, what was dropped and why, factory, loss weights
    model.pt        model state_dict before the update        optimizer.pt  optimizer state_dict
    batch.pt        [{"args": [...], "kwargs": {...}, "autocast": "float16" | None}, ...]
    rng.pt          torch / cuda / python / numpy RNG states (tensors and plain values only)
    stats.json  event.json  config.json
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import registry
from .checkpoint import capture_rng_state, restore_rng_state  # re-exported for replay
from .events import ConfigError, SFMonitorError, jsonable
from .schema import Section, option

__all__ = [
    "BUNDLE_FORMAT",
    "BatchRecorder",
    "BundleConfig",
    "BundleError",
    "BundleTracker",
    "batch_input_stats",
    "capture_rng_state",
    "input_stats",
    "load_bundle",
    "restore_rng_state",
    "write_bundle",
]

BUNDLE_FORMAT = 1
MANIFEST = "manifest.json"
_TENSOR_FILES = ("model", "optimizer", "batch", "rng")  # kept in this priority order
_JSON_FILES = ("stats", "event", "config")


class BundleError(SFMonitorError, ValueError):
    """A bundle is missing, malformed, or holds something other than tensors and plain values."""


@dataclass
class BundleConfig(Section):
    """Anomaly bundles: everything needed to replay the step that went wrong."""

    enabled: bool = option(True, "write a bundle on anomalies (the playbook: save the state at once)")
    dir: str = option("bundles", "folder under run_dir that holds the bundles")
    max_mb: float = option(
        64.0,
        "size cap of one bundle in MiB; the batch, then the optimizer state, "
        "are left out (and the event says so) when they do not fit",
        lo=0.0,
    )
    first_only: bool = option(True, "only the first anomaly of each event kind writes a bundle")
    on_demand: bool = option(
        True, "allow monitor.request_bundle() to write a bundle at any step, whatever first_only says"
    )
    kinds: list[str] = option(
        [], "event kinds that write a bundle; empty: every anomaly kind", choices=registry.event_kinds
    )

    def validate(self) -> None:
        if not self.dir or os.path.isabs(self.dir) or ".." in self.dir.replace("\\", "/").split("/"):
            raise ConfigError(f"{self._prefix}dir: expected a relative folder name inside run_dir, got {self.dir!r}")


class BundleTracker:
    """Which kinds already wrote a bundle (``first_only``); has state_dict for resume."""

    def __init__(self, config: BundleConfig | None = None) -> None:
        self.config = config or BundleConfig()
        self.written: dict[str, int] = {}  # kind -> step of its bundle

    def should_write(self, kind: str, *, on_demand: bool = False) -> bool:
        cfg = self.config
        if not cfg.enabled:
            return False
        if on_demand:
            return cfg.on_demand
        if cfg.kinds and kind not in cfg.kinds:
            return False
        return not (cfg.first_only and kind in self.written)

    def mark(self, kind: str, step: int) -> None:
        self.written.setdefault(kind, int(step))

    def state_dict(self) -> dict[str, Any]:
        return {"written": dict(self.written)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.written = {str(k): int(v) for k, v in dict(sd.get("written", {})).items()}


# --------------------------------------------------------------------------------------------
# input statistics
# --------------------------------------------------------------------------------------------


def _named_tensors(obj: Any, prefix: str, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif depth < 4 and isinstance(obj, dict):
        for k, v in obj.items():
            yield from _named_tensors(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _named_tensors(v, f"{prefix}.{i}" if prefix else str(i), depth + 1)


def _pad_lengths(t: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(pad value, per-row lengths) when a 2-D integer tensor is right-padded with one value.

    Obvious means: the most common value of the last column, found only in trailing runs, one of
    them at least 2 long, with lengths that differ between rows.
    """
    if t.dim() != 2 or t.shape[1] < 2 or t.shape[0] < 1:
        return None
    last = t[:, -1]
    pad = int(torch.mode(last).values) if last.numel() > 1 else int(last[0])
    is_pad = t == pad
    # trailing run: positions j where every column from j to the end is pad
    trailing = torch.flip(torch.cumprod(torch.flip(is_pad, [1]).to(torch.int8), dim=1), [1]).bool()
    runs = trailing.sum(dim=1)
    lengths = t.shape[1] - runs
    # obvious: some row has a run of >= 2 pads, lengths differ, and the pad value occurs nowhere
    # but in the trailing runs (a token id that also appears inside the text is no pad).
    if int(runs.max()) < 2 or int(lengths.min()) == int(lengths.max()) or bool((is_pad & ~trailing).any()):
        return None
    return pad, lengths


def input_stats(args: Any = (), kwargs: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Per tensor input (named ``arg0``, ``images``, ``batch.text``...): shape, dtype and numbers.

    Floating: mean, std, min, max, absmax, nonfinite (count). Integer/bool: min, max, mean, std
    and, for a right-padded 2-D integer tensor or a 2-D bool mask, ``lengths_min/max/mean`` (and
    ``pad``). Computed with one host read; call it on anomalies only.
    """
    named = list(_named_tensors(list(args), "arg")) if args else []
    named = [(n.replace("arg.", "arg", 1), t) for n, t in named]
    if kwargs:
        named += list(_named_tensors(dict(kwargs), ""))
    out: dict[str, dict[str, Any]] = {}
    keys: list[tuple[str, str]] = []
    vals: list[torch.Tensor] = []

    def put(name: str, key: str, v: torch.Tensor) -> None:
        keys.append((name, key))
        vals.append(v.detach().reshape(()).to(device="cpu", dtype=torch.float64))

    with torch.no_grad():
        for name, t in named:
            shape = [t.size(0)] if t.is_nested else list(t.shape)  # (a jagged batch has no one shape)
            info: dict[str, Any] = {"shape": shape, "dtype": str(t.dtype).replace("torch.", "")}
            out[name] = info
            if not _strided(t):
                # a sparse adjacency, a jagged batch: named by its layout; their values are not read
                # (torch.isfinite on a sparse tensor raised inside optimizer.step(): a probe's GCN)
                info["layout"] = "jagged" if t.is_nested else str(t.layout).replace("torch.", "")
                continue
            if t.numel() == 0 or t.is_complex():
                continue
            if t.is_floating_point():
                x = t.detach().double()
                fin = torch.isfinite(x)
                xf = torch.where(fin, x, torch.zeros((), dtype=x.dtype, device=x.device))
                n = fin.sum()
                mean = xf.sum() / n.clamp(min=1)
                var = (torch.where(fin, (x - mean) ** 2, torch.zeros_like(x))).sum() / (n - 1).clamp(min=1)
                big = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
                put(name, "mean", mean)
                put(name, "std", var.sqrt())
                put(name, "min", torch.where(fin, x, big).amin())
                put(name, "max", torch.where(fin, x, -big).amax())
                put(name, "absmax", xf.abs().amax())
                put(name, "nonfinite", (~fin).sum())
            else:
                x = t.detach()
                xd = x.double()
                put(name, "min", xd.amin())
                put(name, "max", xd.amax())
                put(name, "mean", xd.mean())
                put(name, "std", xd.std() if x.numel() > 1 else torch.zeros(()))
                lengths = None
                if x.dtype == torch.bool and x.dim() == 2:
                    lengths = x.sum(dim=1)
                elif x.dim() == 2:
                    found = _pad_lengths(x)
                    if found is not None:
                        info["pad"], lengths = found[0], found[1]
                if lengths is not None:
                    lf = lengths.double()
                    put(name, "lengths_min", lf.amin())
                    put(name, "lengths_max", lf.amax())
                    put(name, "lengths_mean", lf.mean())
    if vals:
        numbers = torch.stack(vals).tolist()  # the one host read
        for (name, key), v in zip(keys, numbers):
            integral = key in ("nonfinite",) or (key.startswith("lengths_") and key != "lengths_mean")
            out[name][key] = int(v) if integral else float(v)
    return out


def batch_input_stats(batches: Iterable[dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """``input_stats`` of each recorded micro-batch (``BatchRecorder.batches``)."""
    return [input_stats(b.get("args", ()), b.get("kwargs", {})) for b in batches]


# --------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------


def forward_rng_state() -> dict[str, Any]:
    """The RNG states a forward pass draws from (torch CPU, and CUDA once initialised): what a
    replay needs for the same dropout masks. Cheap enough for every step, unlike the numpy and
    python states ``capture_rng_state`` adds for checkpoints."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


# --------------------------------------------------------------------------------------------
# batch recorder
# --------------------------------------------------------------------------------------------


def _detach_refs(obj: Any, depth: int = 0) -> Any:
    """Same structure, tensors detached (a view: no copy, no autograd graph kept alive)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if depth >= 6:
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_detach_refs(o, depth + 1) for o in obj)
    if isinstance(obj, list):
        return [_detach_refs(o, depth + 1) for o in obj]
    if isinstance(obj, dict):
        return {k: _detach_refs(v, depth + 1) for k, v in obj.items()}
    return obj


_peek_transform = getattr(torch._C._functorch, "peek_interpreter_stack", lambda: None)


def inside_func_transform() -> bool:
    """Whether this runs inside a torch.func transform (``vmap``, ``grad``: per-sample gradients):
    the tensors a forward sees there are the transform's own and must not be kept past it."""
    return _peek_transform() is not None


def in_backward() -> bool:
    """Whether this runs inside a backward: a forward there is a recomputation (activation
    checkpointing), not one of the loop's."""
    return torch._C._current_graph_task_id() != -1


# Forwards of one optimizer step whose inputs the recorder keeps (and combine() calls a step's
# record keeps apart): gradient accumulation rarely takes more micro-batches; more without a step
# says the loop steps another optimizer.
MAX_STEP_BATCHES = 256


class BatchRecorder:
    """References to the root model's forward inputs for the current optimizer step.

    ``attach(model)`` registers a forward pre-hook (with kwargs) on the root; every forward run with
    autograd enabled appends ``{"args", "kwargs", "autocast"}`` (tensors detached, not copied), up
    to ``max_batches`` a step (the monitor says so: ``Monitor._warn_not_stepping``).
    ``clear()`` at each step start. The RNG state is captured at the step's first forward
    (``capture_rng``), so a replay draws the same dropout masks.

    Each recorded forward's inputs are tallied as they come (``nonfinite_inputs``,
    ``fingerprint``: 0-d / 2-element tensors, no host read).

    A loop that feeds its data to a child of the root, not to the root (a LightningModule's
    ``training_step`` calling ``self.net(x)``), never runs the root's forward: the first direct
    child a step calls outside the root's forward is where its data comes in, and the inputs of
    that child's calls (outside the root) are tallied too. Nothing of theirs is kept for a bundle
    (a replay runs the root).
    """

    def __init__(
        self,
        *,
        capture_rng: bool = True,
        max_batches: int = MAX_STEP_BATCHES,
        keep: bool = True,
    ) -> None:
        self.capture_rng = capture_rng
        self.max_batches = max_batches
        # Called as a forward that computes gradients begins, before it is recorded: True when the
        # forwards recorded so far were thrown away (the monitor's: the loop reset their gradients
        # and made no optimizer step), and the record starts over with this one
        self.on_forward: Callable[[], bool] | None = None
        # keep False: no input is held (no anomaly bundle needs them), and every input is freed
        # as without the monitor
        self.keep = keep
        self.forwards = 0
        self._nonfinite: torch.Tensor | None = None
        self.fingerprint: torch.Tensor | None = None  # see _fingerprint
        self.numel = 0  # elements of the step's input tensors: the batch's size (a short last batch)
        # the shapes per example (all but the first dimension) of each forward's input tensors
        self.shapes: set[tuple[tuple[int, ...], ...]] = set()
        self.batches: list[dict[str, Any]] = []
        self.rng_state: dict[str, Any] | None = None
        self._handle: RemovableHandle | None = None
        self._child_handles: list[RemovableHandle] = []
        self._entry: nn.Module | None = None  # the child the step's data came in through (no root forward)

    def attach(self, model: nn.Module) -> BatchRecorder:
        if self._handle is not None:
            raise RuntimeError("BatchRecorder is already attached; call detach() first")
        self._handle = model.register_forward_pre_hook(self._pre, with_kwargs=True)
        self._child_handles = [
            child.register_forward_pre_hook(self._child_pre, with_kwargs=True)
            for child in model.children()
            if not isinstance(child, torch.jit.ScriptModule)  # (no hooks on those)
        ]
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for h in self._child_handles:
            h.remove()
        self._child_handles = []
        self.clear()

    def clear(self) -> None:
        self.batches = []
        self.rng_state = None
        self.forwards = 0
        self.numel = 0
        self.shapes = set()
        self._nonfinite = self.fingerprint = None
        self._entry = None

    def _child_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # A training forward of the root ran this step (its own pre-hook counted it, before any
        # child's): the step's data came in through the root, and a child gets its outputs.
        # Nor inside torch.compile, torch.func or a recomputation in the backward (checkpointing).
        if self.forwards or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        if inside_func_transform() or in_backward():
            return
        if self._entry is None:
            self._entry = module
        if module is not self._entry:
            return  # (an intermediate passed on to another child: an overflow in the first is no bad input)
        if self.on_forward is not None and self.on_forward():
            self.clear()
            self._entry = module
        self._tally(args, kwargs)

    def _tally(self, args: Any, kwargs: Any) -> None:
        inputs = [args, kwargs]
        self._nonfinite = _add(self._nonfinite, _count_nonfinite(inputs))
        self.fingerprint = _add(self.fingerprint, _fingerprint(inputs))
        plain = [t for _, t in _named_tensors(inputs, "") if _plain(t)]
        self.numel += sum(t.numel() for t in plain)  # (shapes: no read)
        self.shapes.add(tuple(tuple(t.shape[1:]) for t in plain))

    def nonfinite_inputs(self) -> torch.Tensor | None:
        """How many floating input values of this step's micro-batches are NaN or inf, as a 0-d
        tensor (no host read); None when no floating input was recorded. A NaN that arrives with
        the data is a bad batch, not an overflow inside the model."""
        return self._nonfinite

    def _pre(self, module, args, kwargs):
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or inside_func_transform():
            return None  # compiled: nothing is recorded (tracing this hook would break the graph)
        if self.on_forward is not None and self.on_forward():
            self.clear()
        if self.forwards >= self.max_batches:
            return None
        self.forwards += 1
        self._tally(args, kwargs)
        if not self.keep:
            return None
        if not self.batches and self.capture_rng:
            self.rng_state = forward_rng_state()
        dev = next((t.device.type for _, t in _named_tensors([args, kwargs], "")), "cpu")
        amp = _dtype_str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
        self.batches.append(
            {"args": _detach_refs(tuple(args)), "kwargs": _detach_refs(dict(kwargs)), "autocast": amp, "device": dev}
        )
        return None


def _count_nonfinite(inputs: list[Any]) -> torch.Tensor | None:
    """How many floating values of ``inputs`` are NaN or +inf, as a 0-d tensor; None without any.
    -inf is left out: an additive attention mask holds it where a position is hidden (a batch of
    data holding only -inf values is not told apart from a mask)."""
    counts = [
        (torch.isnan(t) | torch.isposinf(t)).sum()
        for _, t in _named_tensors(inputs, "")
        if t.is_floating_point() and _plain(t)
    ]
    if not counts:
        return None
    return torch.stack([c.to(counts[0].device) for c in counts]).sum()


def _fingerprint(inputs: list[Any]) -> torch.Tensor | None:
    """Two numbers that stand for a batch: the sum and the norm of each input tensor, weighted by
    the tensor's place, as a 2-element float32 tensor (no copy of a floating input); None without
    any tensor. Equal, to the last bit, step after step: the loop feeds the same batch (full-batch
    training)."""
    rows = [
        torch.stack([t.sum(dtype=torch.float32), _norm32(t)]) * (i + 1)
        for i, (_, t) in enumerate(_named_tensors(inputs, ""))
        if _plain(t) and not t.is_complex()
    ]
    if not rows:
        return None
    return torch.stack([r.to(rows[0].device) for r in rows]).sum(0)


def _strided(t: torch.Tensor) -> bool:
    """A dense tensor with one storage: not sparse, nor nested (jagged)."""
    return t.layout is torch.strided and not t.is_nested


def _plain(t: torch.Tensor) -> bool:
    """A dense, non-empty tensor whose values reductions read (not a nested, sparse or meta-less
    layout, nor a float8 one, which have no sum of their own): the inputs tallied."""
    if not _strided(t) or not t.numel():
        return False
    return not (t.is_floating_point() and t.element_size() == 1)


def _norm32(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():  # (fp16/bf16 summed in float32, float64 as it is)
        return torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32)).float()
    return torch.linalg.vector_norm(t.float())  # token ids, masks: small


def _add(held: torch.Tensor | None, more: torch.Tensor | None) -> torch.Tensor | None:
    if held is None or more is None:
        return more if held is None else held
    return held + more.to(held.device)


def _dtype_str(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


# --------------------------------------------------------------------------------------------
# bundles
# --------------------------------------------------------------------------------------------

_PLAIN = (str, int, float, bool, type(None))


def _check_plain(obj: Any, where: str, depth: int = 0) -> None:
    """Raise BundleError unless obj holds only tensors, numbers, strings, lists, tuples, dicts."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, _PLAIN):
        return
    if depth > 12:
        raise BundleError(f"{where}: nested too deeply")
    if isinstance(obj, (list, tuple)):
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            raise BundleError(f"{where}: a namedtuple ({type(obj).__name__}) cannot be loaded with weights_only=True")
        for i, o in enumerate(obj):
            _check_plain(o, f"{where}[{i}]", depth + 1)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, _PLAIN):
                raise BundleError(f"{where}: key {k!r} is not a plain value")
            _check_plain(v, f"{where}[{k!r}]", depth + 1)
        return
    raise BundleError(f"{where}: holds a {type(obj).__module__}.{type(obj).__qualname__}, not a tensor or plain value")


def _compact(obj: Any) -> Any:
    """Clone tensor views whose storage is larger than the view (torch.save writes whole storages)."""
    if isinstance(obj, torch.Tensor):
        if not _strided(obj):  # (no one storage: saved as it is)
            return obj.detach()
        if obj.untyped_storage().nbytes() > obj.numel() * obj.element_size():
            return obj.detach().clone()
        return obj.detach()
    if isinstance(obj, tuple):
        return tuple(_compact(o) for o in obj)
    if isinstance(obj, list):
        return [_compact(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _compact(v) for k, v in obj.items()}
    return obj


def _unique_dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    i = 2
    while os.path.exists(path):
        path = os.path.join(root, f"{name}-{i}")
        i += 1
    return path


def write_bundle(
    run_dir: str | os.PathLike,
    step: int,
    kind: str,
    *,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None = None,
    batch: list[dict[str, Any]] | None = None,
    stats: dict[str, float] | None = None,
    event: dict[str, Any] | None = None,
    rng_state: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    model_factory: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    loss_weights: dict[str, float] | None = None,
    max_bytes: int | None = 64 * 2**20,
    dir_name: str = "bundles",
    omitted: Mapping[str, str] | None = None,
) -> str:
    """Write ``run_dir/<dir_name>/<step>-<kind>/`` atomically; return its path.

    ``model_state`` is kept whatever the cap (a bundle without it replays nothing); then the batch,
    the optimizer state and the RNG state are kept in that order while the total stays under
    ``max_bytes``; what is left out is listed in the manifest with the reason
    (``batch_dropped``/``batch_dropped_reason`` for the batch). A batch holding anything but tensors
    and plain values is left out too (it could not be loaded with weights_only=True).
    ``model_factory`` ("module:function") and ``model_kwargs`` (JSON values) let replay rebuild the
    model; ``loss_weights`` are the weights ``combine`` used at that step. ``omitted``: the pieces
    the caller could not give (name: why), listed with the dropped ones.
    """
    if not isinstance(kind, str) or not kind or "/" in kind or kind.startswith("."):
        raise ValueError(f"write_bundle: kind must be a plain name, got {kind!r}")
    if model_factory is not None and (":" not in model_factory or model_factory.count(":") != 1):
        raise ValueError(f"write_bundle: model_factory must be 'module:function', got {model_factory!r}")
    if model_kwargs is not None:
        try:
            json.dumps(model_kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"write_bundle: model_kwargs must be JSON values: {e}") from e
    _check_plain(model_state, "model_state")
    if optimizer_state is not None:
        _check_plain(optimizer_state, "optimizer_state")
    root = os.path.join(os.fspath(run_dir), dir_name)
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-{int(step)}-{kind}-{os.getpid()}-{time.monotonic_ns()}")
    os.makedirs(tmp)
    try:
        manifest: dict[str, Any] = {
            "format": BUNDLE_FORMAT,
            "step": int(step),
            "kind": kind,
            "created": time.time(),
            "torch": torch.__version__,
            "model_factory": model_factory,
            "model_kwargs": model_kwargs or {},
            "loss_weights": {str(k): float(v) for k, v in (loss_weights or {}).items()},
            "max_bytes": max_bytes,
            "files": {},
            "dropped": dict(omitted or {}),
            "batch_dropped": False,
            "batch_dropped_reason": None,
            "autocast": next((b.get("autocast") for b in (batch or []) if b.get("autocast")), None),
            "micro_batches": len(batch) if batch is not None else 0,
        }
        cap = float("inf") if max_bytes is None else int(max_bytes)
        total = 0
        for name in _JSON_FILES:
            value = {"stats": stats, "event": event, "config": config}[name]
            if value is None:
                continue
            path = os.path.join(tmp, name + ".json")
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(jsonable(value), fh, indent=1, sort_keys=True)
            manifest["files"][name] = name + ".json"
            total += os.path.getsize(path)
        pieces = {"model": model_state, "batch": batch, "optimizer": optimizer_state, "rng": rng_state}
        for name in ("model", "batch", "optimizer", "rng"):
            piece = pieces[name]
            if piece is None:
                continue
            if name in ("batch", "rng"):
                try:
                    _check_plain(piece, name)
                except BundleError as e:
                    manifest["dropped"][name] = f"not loadable with weights_only=True: {e}"
                    continue
                piece = _compact(piece)
            path = os.path.join(tmp, name + ".pt")
            torch.save(piece, path)
            size = os.path.getsize(path)
            if name != "model" and total + size > cap:
                os.remove(path)
                manifest["dropped"][name] = (
                    f"{size} bytes would bring the bundle to {total + size} bytes, over the cap of {int(cap)} bytes"
                )
                continue
            total += size
            manifest["files"][name] = name + ".pt"
        if "model" in manifest["files"] and total > cap:
            manifest["over_cap"] = f"the model state alone takes the bundle to {total} bytes (cap {int(cap)})"
        if "batch" in manifest["dropped"]:
            manifest["batch_dropped"] = True
            manifest["batch_dropped_reason"] = manifest["dropped"]["batch"]
        manifest["bytes"] = total
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as fh:
            json.dump(jsonable(manifest), fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        final = _unique_dir(root, f"{int(step)}-{kind}")
        os.rename(tmp, final)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


# Manifest fields replay and the monitor read, and the types they must have when present.
_MANIFEST_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "files": ((dict,), "a mapping"),
    "dropped": ((dict,), "a mapping"),
    "loss_weights": ((dict,), "a mapping"),
    "model_kwargs": ((dict,), "a mapping"),
    "model_factory": ((str, type(None)), "a string or null"),
    "kind": ((str,), "a string"),
    "step": ((int,), "an integer"),
    "micro_batches": ((int,), "an integer"),
    "autocast": ((str, type(None)), "a string or null"),
    "batch_dropped": ((bool,), "true or false"),
    "batch_dropped_reason": ((str, type(None)), "a string or null"),
}


def _check_manifest(mpath: str, manifest: dict[str, Any]) -> None:
    """Raise BundleError naming the manifest and the field whose type replay could not use."""
    for key, (types, what) in _MANIFEST_TYPES.items():
        if key not in manifest:
            continue
        value = manifest[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise BundleError(f"{mpath}: field {key!r} must be {what}, got {value!r:.80}")
    for name, fname in (manifest.get("files") or {}).items():
        if not isinstance(fname, str):
            raise BundleError(f"{mpath}: files[{name!r}] must be a file name, got {fname!r:.80}")
    for name, w in (manifest.get("loss_weights") or {}).items():
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise BundleError(f"{mpath}: loss_weights[{name!r}] must be a number, got {w!r:.80}")
    if manifest.get("micro_batches", 0) < 0:
        raise BundleError(f"{mpath}: micro_batches must be >= 0, got {manifest['micro_batches']}")


def load_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A bundle's manifest (plain JSON: what was kept, what was dropped and why).

    Raises BundleError naming the manifest when it is missing, unreadable (not UTF-8, not JSON,
    nested too deeply), of another format, or has a field of the wrong type.
    """
    path = os.fspath(path)
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise BundleError(f"{path!r} is not an anomaly bundle: {MANIFEST} is missing")
    try:
        with open(mpath, "rb") as fh:
            manifest = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or bad JSON
        raise BundleError(f"{mpath}: cannot read the manifest: {_first_line(e)}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise BundleError(f"{mpath}: unknown bundle format {found!r:.80} (this sfmonitor reads format {BUNDLE_FORMAT})")
    _check_manifest(mpath, manifest)
    return manifest


def load_bundle(path: str | os.PathLike) -> dict[str, Any]:
    """Load a bundle with ``torch.load(weights_only=True)`` only.

    Returns {"path", "manifest", "model_state", "optimizer_state", "batch", "rng_state", "stats",
    "event", "config"} (None for what the bundle left out). Whatever is wrong with a bundle --
    a missing, truncated or corrupt file, a file holding a pickled callable or any other
    non-tensor object, a value of the wrong shape (a batch that is not a list of micro-batch
    dicts...) -- raises BundleError naming the file; no other exception escapes.
    """
    path = os.fspath(path)
    manifest = load_manifest(path)
    files = manifest.get("files") or {}
    out: dict[str, Any] = {"path": path, "manifest": manifest}
    keys = {"model": "model_state", "optimizer": "optimizer_state", "batch": "batch", "rng": "rng_state"}
    for name, key in keys.items():
        fname = files.get(name)
        out[key] = _load_tensor_file(path, fname, name) if fname else None
    for name in _JSON_FILES:
        fname = files.get(name)
        if not fname:
            out[name] = None
            continue
        fpath = _inside(path, fname)
        try:
            with open(fpath, "rb") as fh:
                value = json.loads(fh.read().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise BundleError(f"cannot load {fpath}: {_first_line(e)}") from e
        if not isinstance(value, dict):
            raise BundleError(f"{fpath}: expected a JSON object, got {type(value).__name__}")
        out[name] = value
    if out["model_state"] is None:
        raise BundleError(f"{path!r}: the bundle holds no model state")
    return out


def _inside(path: str, fname: str) -> str:
    if not isinstance(fname, str) or os.path.basename(fname) != fname or fname.startswith("."):
        raise BundleError(f"{path!r}: manifest names a file outside the bundle: {fname!r}")
    return os.path.join(path, fname)


def _check_shape(fpath: str, name: str, value: Any) -> None:
    """The shapes replay relies on: state dicts are dicts, the batch a list of micro-batch dicts."""

    def bad(what: str) -> BundleError:
        return BundleError(f"{fpath}: {what}")

    if name in ("model", "optimizer", "rng") and not isinstance(value, dict):
        raise bad(f"expected a dict ({name} state), got {type(value).__name__}")
    if name == "model" and not all(isinstance(k, str) for k in value):
        raise bad("model state keys must be parameter names (strings)")
    if name == "rng":
        if "torch" in value and not (isinstance(value["torch"], torch.Tensor) and value["torch"].dtype == torch.uint8):
            raise bad("rng state 'torch' must be a uint8 tensor")
        cuda = value.get("cuda", [])
        if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
            raise bad("rng state 'cuda' must be a list of uint8 tensors")
        for k in ("numpy", "python"):
            if k in value and not isinstance(value[k], dict):
                raise bad(f"rng state {k!r} must be a dict")
    if name == "batch":
        if not isinstance(value, list):
            raise bad(f"expected a list of micro-batches, got {type(value).__name__}")
        for i, mb in enumerate(value):
            if not isinstance(mb, dict):
                raise bad(f"micro-batch {i} is a {type(mb).__name__}, not a dict")
            if not isinstance(mb.get("args", ()), (list, tuple)):
                raise bad(f"micro-batch {i}: 'args' must be a list")
            kwargs = mb.get("kwargs", {})
            if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
                raise bad(f"micro-batch {i}: 'kwargs' must be a dict with string keys")
            amp = mb.get("autocast")
            if amp is not None and not (
                isinstance(amp, str)
                and isinstance(getattr(torch, amp, None), torch.dtype)
                and getattr(torch, amp).is_floating_point
            ):
                raise bad(f"micro-batch {i}: 'autocast' must be a floating dtype name, got {amp!r:.80}")
            if not isinstance(mb.get("device", "cpu"), str):
                raise bad(f"micro-batch {i}: 'device' must be a string")


def _load_tensor_file(path: str, fname: str, name: str | None = None) -> Any:
    fpath = _inside(path, fname)
    try:
        value = torch.load(fpath, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BundleError(
            f"refusing {fpath}: it holds a pickled object that is not a tensor or plain "
            f"value (bundles load with weights_only=True only), or is not a valid "
            f"pickle: {first}"
        ) from e
    except Exception as e:
        # UnicodeDecodeError, KeyError, EOFError, RuntimeError, MemoryError...): one typed error
        raise BundleError(f"cannot load {fpath} (truncated, corrupt or not a torch file): {_first_line(e)}") from e
    _check_plain(value, fname)
    if name is not None:
        _check_shape(fpath, name, value)
    return value
