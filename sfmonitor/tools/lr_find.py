"""LR range test: ``sfmonitor.lr_find(model, optimizer, loader, loss_fn)``.

The field report's playbook: *"LR range test: if the loss moves by more than 10x its initial value,
the initial LR is too large; prefer a triangular cyclical LR schedule."* The test
(Smith 2017, "Cyclical Learning Rates for Training Neural Networks", section 3.3):

1. raise the learning rate every optimizer step from ``start_lr`` to ``end_lr`` over ``num_iter``
   steps, exponentially (default) or linearly;
2. record the loss of each step and smooth it with a bias-corrected exponential moving average
   (``smoothing`` = beta, 0.95 as torch-lr-finder's smooth_f=0.05; fastai uses 0.98, which lags
   more: over 100 steps its time constant is half the sweep);
3. stop when the smoothed loss exceeds ``diverge_factor`` (10, the report) times the best (or the
   initial) smoothed loss, or when the loss turns non-finite;
4. put the model, the optimizer, the GradScaler, the RNG and the modules' train/eval modes back
   bit-exactly as they were: the sweep leaves no trace on the user's run.

What it suggests (``LRFindResult``):

- ``lr_steepest``: the LR where the smoothed loss falls fastest (most negative slope against
  log10(lr) over a window of +-5% of the steps, searched after the first 10% and before the
  minimum);
- ``lr_min_loss``: the LR of the minimum smoothed loss; ``lr_min_loss / 10`` is the classic safe
  choice (fastai, Smith's one-cycle);
- ``suggested_lr``: ``lr_steepest`` where it exists, else ``lr_min_loss / 10``; None (and
  ``result.flat``) when the smoothed loss never fell ``min_drop`` (2%) below its first value:
  the sweep was too short to show a descent, and no number is better than a made-up one;
- ``lr_diverged``: the LR at which the sweep stopped on divergence (None when it did not);
- ``cyclic_base_lr``/``cyclic_max_lr``: a triangular ``torch.optim.lr_scheduler.CyclicLR`` range:
  ``max_lr = lr_min_loss / 10`` (a decade before the minimum, where the loss still falls),
  ``base_lr = max_lr / 4`` (Smith 2017, 3.3: "1/3 or 1/4 of the maximum");
  ``result.cyclic_lr(optimizer, step_size_up)`` builds the scheduler.

Each sweep step is one optimizer step: ``accumulation`` micro-batches of ``loss_fn(model, batch)``
(a tensor, or a dict of tensors summed with ``weights``), under ``torch.autocast`` when
``autocast_dtype`` is given, scaled by ``scaler`` when one is given (steps the scaler skips are
counted, not treated as divergence). The loader is iterated again when it runs out; a one-shot
iterator ends the sweep instead. One host read per step (the loss and its components together).

Run it *before* attaching a Monitor: an attached monitor's optimizer hooks would see the sweep's
steps (a warning says so).

The ``sfmonitor lr-find`` command is a preset of this function on one model; the package that
ships the model registers it (entry point group ``sfmonitor.commands``, see ``sfmonitor.cli``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint import copy_tree
from ..events import ConfigError
from ..schema import Section, option

__all__ = [
    "STOP_COMPLETED",
    "STOP_DIVERGED",
    "STOP_LOADER_EXHAUSTED",
    "STOP_NONFINITE",
    "LRFindConfig",
    "LRFindResult",
    "lr_find",
]

INSTALL_HINT = "pip install 'sfmonitor[report]'"
JSON_FILE = "lr_find.json"  # --out DIR / save(): the curve and the suggestions
PNG_FILE = "lr_find.png"  # --out DIR / save(): loss against LR (log x axis)

# Why the sweep ended (LRFindResult.stop_reason)
STOP_COMPLETED = "completed"  # all num_iter steps ran
STOP_DIVERGED = "diverged"  # smoothed loss > diverge_factor x reference
STOP_NONFINITE = "nonfinite"  # the loss turned inf/NaN
STOP_LOADER_EXHAUSTED = "loader_exhausted"  # a one-shot iterator ran out

MIN_LOSS_DIVISOR = 10.0  # lr_min_loss / 10: fastai's "minimum / 10" rule (Smith's one-cycle)
CYCLIC_BASE_RATIO = 0.25  # base_lr = max_lr / 4: Smith 2017, section 3.3 ("1/3 or 1/4")


@dataclass
class LRFindConfig(Section):
    """Settings of one LR range test (keyword arguments of ``lr_find``)."""

    start_lr: float = option(1e-7, "first learning rate of the sweep", lo=0.0, lo_open=True)
    end_lr: float = option(10.0, "last learning rate of the sweep (reached at step num_iter - 1)", lo=0.0, lo_open=True)
    num_iter: int = option(100, "optimizer steps of the sweep at most", lo=2)
    mode: str = option(
        "exp", "exp: geometric steps from start_lr to end_lr; linear: equal steps", choices=("exp", "linear")
    )
    smoothing: float = option(
        0.95,
        "beta of the bias-corrected EMA of the loss (0: no smoothing; torch-lr-finder: 0.95, fastai: 0.98)",
        lo=0.0,
        hi=0.999,
    )
    diverge_factor: float = option(
        10.0, "stop when the smoothed loss exceeds this x the reference loss (the report: 10x)", lo=1.0, lo_open=True
    )
    diverge_reference: str = option(
        "best",
        "reference loss of the divergence test: best (lowest smoothed loss so far) or initial (the report's wording)",
        choices=("best", "initial"),
    )
    accumulation: int = option(1, "micro-batches per optimizer step (loss averaged over them)", lo=1)
    max_grad_norm: float = option(0.0, "clip the total gradient norm before each step (0: off)", lo=0.0)
    skip_start: float = option(
        0.1, "share of the first steps the steepest-descent search ignores (torch-lr-finder: 10 of 100)", lo=0.0, hi=0.9
    )
    min_drop: float = option(
        0.02,
        "the smoothed loss must fall below (1 - min_drop) x the initial loss for a suggestion; a flat curve gives none",
        lo=0.0,
        hi=0.99,
    )
    slope_window: float = option(
        0.05,
        "half-width of the slope's finite difference, as a share of the steps run (at least one step)",
        lo=0.0,
        hi=0.25,
    )

    def validate(self) -> None:
        if self.end_lr <= self.start_lr:
            raise ConfigError(
                f"{self._prefix}end_lr: must be greater than start_lr ({self.start_lr!r}), got {self.end_lr!r}"
            )

    def schedule(self) -> list[float]:
        """The num_iter learning rates of the sweep."""
        n = self.num_iter - 1
        if self.mode == "exp":
            ratio = self.end_lr / self.start_lr
            return [self.start_lr * ratio ** (i / n) for i in range(self.num_iter)]
        return [self.start_lr + (self.end_lr - self.start_lr) * i / n for i in range(self.num_iter)]


@dataclass
class LRFindResult:
    """The curve and what it suggests. ``to_dict()`` is what ``lr_find.json`` holds."""

    lrs: list[float]
    """learning rate of each step that ran (of the optimizer's largest-LR param group)"""
    losses: list[float]
    """raw loss of each step (mean over its micro-batches); the last may be non-finite"""
    smoothed: list[float]
    """bias-corrected EMA of the loss; NaN where the raw loss was non-finite"""
    components: dict[str, list[float]]
    """raw loss per component when loss_fn returns a dict (unweighted), else empty"""
    suggested_lr: float | None
    """lr_steepest where it exists, else lr_min_loss / 10; None when the smoothed loss never fell
    below (1 - min_drop) x its initial value (a flat curve: sweep longer) or no loss was finite"""
    lr_steepest: float | None
    """LR of the steepest fall of the smoothed loss (against log10(lr)) before its minimum"""
    lr_min_loss: float | None
    """LR of the minimum smoothed loss"""
    lr_diverged: float | None
    """LR of the step where the sweep stopped on divergence or a non-finite loss, else None"""
    stop_reason: str
    """completed, diverged, nonfinite or loader_exhausted"""
    cyclic_base_lr: float | None
    """suggested CyclicLR base_lr (cyclic_max_lr / 4, Smith 2017)"""
    cyclic_max_lr: float | None
    """suggested CyclicLR max_lr (lr_min_loss / 10)"""
    initial_loss: float | None
    """first finite smoothed loss (= the first loss)"""
    min_loss: float | None
    """minimum smoothed loss"""
    current_lr: float
    """the optimizer's (largest) LR before the sweep"""
    skipped_steps: int = 0
    """steps the GradScaler skipped (inf/NaN gradients) during the sweep"""
    config: dict[str, Any] = field(default_factory=dict)
    """the LRFindConfig the sweep ran with"""
    seconds: float = 0.0
    """wall time of the sweep"""

    @property
    def diverged(self) -> bool:
        return self.stop_reason in (STOP_DIVERGED, STOP_NONFINITE)

    @property
    def flat(self) -> bool:
        """The loss never fell by min_drop: no suggestion (more num_iter, or a higher start_lr)."""
        return self.min_loss is not None and self.suggested_lr is None

    @property
    def iterations(self) -> int:
        return len(self.lrs)

    @property
    def current_lr_too_large(self) -> bool | None:
        """The report's test: does the optimizer's own LR sit at or past the LR where the loss
        diverged (moved by more than diverge_factor x)? None when the sweep never diverged and
        never reached current_lr."""
        if self.lr_diverged is not None:
            return self.current_lr >= self.lr_diverged
        if self.lrs and self.current_lr <= self.lrs[-1]:
            return False
        return None

    def cyclic_lr(
        self, optimizer: torch.optim.Optimizer, step_size_up: int = 2000, **kwargs: Any
    ) -> torch.optim.lr_scheduler.CyclicLR:
        """A triangular CyclicLR over the suggested range (``cycle_momentum=False`` unless given).

        Note: CyclicLR sets the optimizer's LRs to base_lr when it is built.
        """
        if self.cyclic_base_lr is None or self.cyclic_max_lr is None:
            raise ValueError("no cyclic range: the sweep saw no finite loss")
        kwargs.setdefault("mode", "triangular")
        kwargs.setdefault("cycle_momentum", False)
        return torch.optim.lr_scheduler.CyclicLR(
            optimizer, base_lr=self.cyclic_base_lr, max_lr=self.cyclic_max_lr, step_size_up=step_size_up, **kwargs
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(
            diverged=self.diverged,
            flat=self.flat,
            iterations=self.iterations,
            current_lr_too_large=self.current_lr_too_large,
        )
        return _json_safe(d)

    def table(self, rows: int = 20) -> str:
        """About ``rows`` evenly spaced steps (plus the marked ones) as a text table."""
        n = len(self.lrs)
        if n == 0:
            return "(no steps ran)"
        marks: dict[int, list[str]] = {}
        for name, lr in (
            ("steepest", self.lr_steepest),
            ("min loss", self.lr_min_loss),
            ("diverged", self.lr_diverged),
        ):
            if lr is not None:
                marks.setdefault(min(range(n), key=lambda i: abs(self.lrs[i] - lr)), []).append(name)
        stride = max(1, math.ceil(n / max(rows, 1)))
        idx = sorted(set(range(0, n, stride)) | {n - 1} | set(marks))
        lines = [
            f"{'step':>5}  {'lr':>10}  {'loss':>10}  {'smoothed':>10}  note",
            f"{'-' * 5}  {'-' * 10}  {'-' * 10}  {'-' * 10}  ----",
        ]
        for i in idx:
            lines.append(
                f"{i:>5}  {self.lrs[i]:>10.3e}  {_fmt(self.losses[i])}  "
                f"{_fmt(self.smoothed[i])}  {', '.join(marks.get(i, []))}".rstrip()
            )
        return "\n".join(lines)

    def summary(self) -> str:
        """The suggestion in a few lines."""
        out = [
            f"stopped: {self.stop_reason} after {self.iterations} steps"
            + (f" (GradScaler skipped {self.skipped_steps})" if self.skipped_steps else "")
        ]
        if self.min_loss is None:
            out.append("no finite loss: no suggestion (is start_lr already too large?)")
        elif self.suggested_lr is None:
            out.append(
                f"flat: the smoothed loss never fell {self.config.get('min_drop', 0):.0%} below "
                f"its initial {self.initial_loss:.4g}: no suggestion; sweep longer "
                f"(num_iter) or start higher (start_lr)"
            )
        else:
            out.append(
                f"suggested lr:   {self.suggested_lr:.3e}"
                + (" (steepest descent)" if self.lr_steepest is not None else " (min loss / 10)")
            )
            out.append(
                f"min loss:       {self.min_loss:.4g} at lr {self.lr_min_loss:.3e} (initial {self.initial_loss:.4g})"
            )
        if self.lr_diverged is not None:
            out.append(f"diverged at lr: {self.lr_diverged:.3e}")
        if self.cyclic_max_lr is not None:
            out.append(
                f"cyclic range:   CyclicLR(base_lr={self.cyclic_base_lr:.3e}, "
                f"max_lr={self.cyclic_max_lr:.3e}, mode='triangular')"
            )
        verdict = self.current_lr_too_large
        if verdict is True:
            out.append(f"current lr {self.current_lr:.3e} is too large: the loss diverged at {self.lr_diverged:.3e}")
        elif verdict is False and self.lr_diverged is not None:
            out.append(f"current lr {self.current_lr:.3e} is below the divergence point")
        elif verdict is False:
            out.append(f"current lr {self.current_lr:.3e}: the sweep passed it without diverging")
        return "\n".join(out)

    def save(self, out_dir: str, plot: bool = True) -> dict[str, str]:
        """Write ``lr_find.json`` (and ``lr_find.png`` when plot) into out_dir; return the paths."""
        os.makedirs(out_dir, exist_ok=True)
        paths = {"json": os.path.join(out_dir, JSON_FILE)}
        tmp = paths["json"] + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1)
        os.replace(tmp, paths["json"])
        if plot:
            paths["png"] = os.path.join(out_dir, PNG_FILE)
            self.plot(paths["png"])
        return paths

    def plot(self, path: str) -> None:
        """Loss and smoothed loss against LR (log x), with the suggestions as vertical lines."""
        try:  # lazy and without pyplot: no global backend change
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError(f"lr_find plots need matplotlib: {INSTALL_HINT} ({e})") from e
        fig = Figure(figsize=(7, 4), dpi=96)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        fin = [(lr, loss) for lr, loss in zip(self.lrs, self.losses) if math.isfinite(loss)]
        if fin:
            ax.plot(*zip(*fin), color="#bbbbbb", lw=1, label="loss")
        sm = [(lr, s) for lr, s in zip(self.lrs, self.smoothed) if math.isfinite(s)]
        if sm:
            ax.plot(*zip(*sm), color="black", lw=1.6, label="smoothed")
        for lr, name, color in (
            (self.suggested_lr, "suggested", "#2ca02c"),
            (self.lr_min_loss, "min loss", "#1f77b4"),
            (self.lr_diverged, "diverged", "#d62728"),
        ):
            if lr is not None:
                ax.axvline(lr, color=color, ls="--", lw=1, label=f"{name} {lr:.2e}")
        base_lr, max_lr = self.cyclic_base_lr, self.cyclic_max_lr
        if base_lr is not None and max_lr is not None:  # set together by the analysis
            ax.axvspan(base_lr, max_lr, color="#ff9f1c", alpha=0.2, label="cyclic range")
        if self.config.get("mode", "exp") == "exp":
            ax.set_xscale("log")
        if sm:  # keep the plot readable: clip the y range at a few times the initial loss
            lo = min([s for _, s in sm] + [loss for _, loss in fin])
            hi = max(s for _, s in sm[: max(1, len(sm) // 10)])
            span = max(hi - lo, abs(lo) * 0.05, 1e-12)
            ax.set_ylim(lo - 0.1 * span, hi + 1.5 * span)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        ax.set_title(f"LR range test ({self.stop_reason} after {self.iterations} steps)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, format="png")


def _fmt(x: float) -> str:
    return f"{x:>10.4g}" if math.isfinite(x) else f"{x!s:>10}"


def _json_safe(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


# --------------------------------------------------------------------------------------------
# Snapshot / restore: the sweep leaves no trace
# --------------------------------------------------------------------------------------------


class _Snapshot:
    """Everything the sweep may change, copied: parameters (the model's and the optimizer's),
    their .grad, every buffer (persistent or not), the optimizer state and param groups, the
    GradScaler, the torch RNG (CPU and CUDA), each module's training flag."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None):
        tensors: dict[int, torch.Tensor] = {}
        for p in model.parameters():
            tensors[id(p)] = p
        for g in optimizer.param_groups:
            for p in g["params"]:
                tensors[id(p)] = p
        for b in model.buffers():
            tensors[id(b)] = b
        with torch.no_grad():
            self.values = [(t, t.detach().clone()) for t in tensors.values()]
            self.grads = [(t, None if t.grad is None else t.grad.detach().clone()) for t in tensors.values()]
        self.optimizer = copy_tree(optimizer.state_dict())
        self.scaler = copy_tree(scaler.state_dict()) if scaler is not None else None
        self.modes = [(m, m.training) for m in model.modules()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> None:
        with torch.no_grad():
            for t, v in self.values:
                t.copy_(v)
            for t, g in self.grads:
                t.grad = None if g is None else g.clone()
        optimizer.load_state_dict(copy_tree(self.optimizer))
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(self.scaler)
        for m, mode in self.modes:
            m.training = mode
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------


def _check_args(model, optimizer, loader, loss_fn, weights, scaler, autocast_dtype) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    try:
        iter(loader)
    except TypeError:
        raise ValueError(f"loader: expected an iterable of batches, got {type(loader).__name__}") from None
    if not callable(loss_fn):
        raise ValueError(f"loss_fn: expected a callable loss_fn(model, batch) -> loss, got {type(loss_fn).__name__}")
    if weights is not None:
        if not isinstance(weights, Mapping):
            raise ValueError(f"weights: expected a dict {{component: weight}}, got {type(weights).__name__}")
        for k, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ValueError(f"weights[{k!r}]: expected a finite number, got {w!r}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(f"scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    if autocast_dtype is not None and autocast_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast_dtype: expected torch.float16, torch.bfloat16 or None, got {autocast_dtype!r}")
    if not any(len(g["params"]) for g in optimizer.param_groups):
        raise ValueError("optimizer: has no parameters")


def _total(out: Any, weights: Mapping[str, float] | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss_fn's output -> (weighted total, {component: loss}) ; validates it."""
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            raise ValueError(f"loss_fn: must return a scalar loss, got a tensor of shape {tuple(out.shape)}")
        if weights is not None:
            raise ValueError("weights: given, but loss_fn returned a single tensor, not a dict")
        return out.reshape(()), {}
    if isinstance(out, Mapping):
        if not out:
            raise ValueError("loss_fn: returned an empty dict")
        for k, v in out.items():
            if not isinstance(v, torch.Tensor) or v.numel() != 1:
                raise ValueError(f"loss_fn: component {k!r} must be a scalar tensor, got {v!r:.60}")
        if weights is not None:
            missing = sorted(set(out) - set(weights))
            extra = sorted(set(weights) - set(out))
            if missing or extra:
                raise ValueError(
                    f"weights: keys must match loss_fn's components {sorted(out)}; missing {missing}, unknown {extra}"
                )
        comps = {str(k): v.reshape(()) for k, v in out.items()}
        total = sum(v.float() * (1.0 if weights is None else float(weights[k])) for k, v in comps.items())
        return total, comps
    raise ValueError(f"loss_fn: must return a loss tensor or a dict of loss tensors, got {type(out).__name__}")


class _Batches:
    """Batches forever from a re-iterable loader; a one-shot iterator ends after one pass."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.one_shot = iter(loader) is loader
        self.it = iter(loader)

    def next(self) -> Any:
        """The next batch, or raises StopIteration when a one-shot iterator is exhausted."""
        try:
            return next(self.it)
        except StopIteration:
            if self.one_shot:
                raise
        self.it = iter(self.loader)
        try:
            return next(self.it)
        except StopIteration:
            raise ValueError("loader: yielded no batches") from None


def lr_find(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor | Mapping[str, torch.Tensor]],
    *,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_iter: int = 100,
    mode: str = "exp",
    smoothing: float = 0.95,
    diverge_factor: float = 10.0,
    diverge_reference: str = "best",
    accumulation: int = 1,
    max_grad_norm: float = 0.0,
    skip_start: float = 0.1,
    slope_window: float = 0.05,
    min_drop: float = 0.02,
    weights: Mapping[str, float] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    autocast_dtype: torch.dtype | None = None,
    out_dir: str | None = None,
    plot: bool = True,
) -> LRFindResult:
    """LR range test; see the module docstring. Returns an ``LRFindResult``.

    ``loss_fn(model, batch)`` returns a scalar loss tensor or a dict of them (summed, times
    ``weights[name]`` when given). ``scaler``: a GradScaler the steps go through;
    ``autocast_dtype``: run loss_fn under ``torch.autocast(<device of the parameters>, dtype)``.
    ``out_dir``: write lr_find.json (and lr_find.png when ``plot``). The model, the optimizer, the
    scaler, the torch RNG and train/eval modes are restored bit-exactly afterwards, also when
    loss_fn raises. Bad arguments raise ValueError naming the argument.
    """
    cfg = LRFindConfig(
        start_lr=start_lr,
        end_lr=end_lr,
        num_iter=num_iter,
        mode=mode,
        smoothing=smoothing,
        diverge_factor=diverge_factor,
        diverge_reference=diverge_reference,
        accumulation=accumulation,
        max_grad_norm=max_grad_norm,
        skip_start=skip_start,
        slope_window=slope_window,
        min_drop=min_drop,
    )
    _check_args(model, optimizer, loader, loss_fn, weights, scaler, autocast_dtype)
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        warnings.warn(
            "lr_find: the optimizer has step hooks (an attached sfmonitor.Monitor?); they "
            "will see the sweep's steps. Run lr_find before attaching.",
            stacklevel=2,
        )

    t0 = time.perf_counter()
    snapshot = _Snapshot(model, optimizer, scaler)
    try:
        result = _sweep(model, optimizer, loader, loss_fn, cfg, weights, scaler, autocast_dtype)
    finally:
        snapshot.restore(model, optimizer, scaler)
    result.seconds = round(time.perf_counter() - t0, 3)
    if out_dir is not None:
        result.save(out_dir, plot=plot)
    return result


def _sweep(model, optimizer, loader, loss_fn, cfg: LRFindConfig, weights, scaler, autocast_dtype) -> LRFindResult:
    groups = optimizer.param_groups
    base = [float(g["lr"]) for g in groups]
    top = max(base)
    # Each group keeps its LR relative to the largest one (a frozen group at 0 stays at 0).
    ratios = [b / top if top > 0 else 1.0 for b in base]
    params = [p for g in groups for p in g["params"]]
    device = params[0].device
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    use_scaler = scaler is not None and scaler.is_enabled()

    batches = _Batches(loader)
    lrs, losses, smoothed = [], [], []
    components: dict[str, list[float]] = {}
    avg, best, initial = 0.0, math.inf, None
    stop, skipped = STOP_COMPLETED, 0
    model.train()
    for i, lr in enumerate(cfg.schedule()):
        for g, r in zip(groups, ratios):
            g["lr"] = lr * r
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        comp_sum: dict[str, torch.Tensor] = {}
        try:
            for _ in range(cfg.accumulation):
                batch = batches.next()
                with amp:
                    loss, comps = _total(loss_fn(model, batch), weights)
                loss = loss.float() / cfg.accumulation
                (scaler.scale(loss) if use_scaler else loss).backward()
                total = total + loss.detach()
                for k, v in comps.items():
                    comp_sum[k] = comp_sum.get(k, 0) + v.detach().float() / cfg.accumulation
        except StopIteration:
            stop = STOP_LOADER_EXHAUSTED
            break
        # one host read per step: the loss and its components together
        names = list(comp_sum)
        values = torch.stack([total] + [comp_sum[k].reshape(()) for k in names]).cpu().tolist()
        value = values[0]
        lrs.append(lr)
        losses.append(value)
        for k, v in zip(names, values[1:]):
            components.setdefault(k, []).append(v)
        if not math.isfinite(value):  # never enters the average; the sweep is over
            smoothed.append(math.nan)
            stop = STOP_NONFINITE
            break
        avg = cfg.smoothing * avg + (1 - cfg.smoothing) * value
        s = avg / (1 - cfg.smoothing ** (len(smoothed) + 1))
        smoothed.append(s)
        if initial is None:
            initial = s
        best = min(best, s)
        ref = best if cfg.diverge_reference == "best" else initial
        # "moves by more than 10x": for a positive reference this is s > factor * ref
        if s > ref + (cfg.diverge_factor - 1) * abs(ref):
            stop = STOP_DIVERGED
            break
        if i == cfg.num_iter - 1:
            break  # last step: its loss is recorded, its update would be thrown away
        if cfg.max_grad_norm > 0:
            if use_scaler:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        if use_scaler:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += int(scaler.get_scale() < before)
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return _analyse(cfg, lrs, losses, smoothed, components, stop, skipped, top)


def _analyse(
    cfg: LRFindConfig,
    lrs: list[float],
    losses: list[float],
    smoothed: list[float],
    components: dict[str, list[float]],
    stop: str,
    skipped: int,
    current_lr: float,
) -> LRFindResult:
    finite = [i for i, s in enumerate(smoothed) if math.isfinite(s)]
    lr_diverged = lrs[-1] if stop in (STOP_DIVERGED, STOP_NONFINITE) and lrs else None
    res = LRFindResult(
        lrs=lrs,
        losses=losses,
        smoothed=smoothed,
        components=components,
        stop_reason=stop,
        lr_diverged=lr_diverged,
        current_lr=current_lr,
        skipped_steps=skipped,
        config=cfg.to_dict(),
        suggested_lr=None,
        lr_steepest=None,
        lr_min_loss=None,
        cyclic_base_lr=None,
        cyclic_max_lr=None,
        initial_loss=None,
        min_loss=None,
    )
    if not finite:
        return res
    i_min = min(finite, key=lambda i: smoothed[i])
    initial = smoothed[finite[0]]
    res = dataclasses.replace(res, lr_min_loss=lrs[i_min], min_loss=smoothed[i_min], initial_loss=initial)
    if not smoothed[i_min] < initial - cfg.min_drop * abs(initial):
        return res  # flat: the loss never fell, so no LR is shown to train
    # Steepest descent: most negative slope of the smoothed loss against log10(lr) (or lr when
    # linear), measured over +-w steps (w = slope_window x the steps run, so one noisy batch does
    # not make a slope), searched from skip_start x the steps run up to the minimum: past the
    # minimum the loss no longer falls.
    x = [math.log10(lr) if cfg.mode == "exp" else lr for lr in lrs]
    w = max(1, round(cfg.slope_window * len(lrs)))
    lo = max(w, round(cfg.skip_start * len(lrs)))
    steepest: float | None = None
    best_slope = 0.0
    for j in range(lo, i_min - w + 1):
        a, b = j - w, j + w
        if not (math.isfinite(smoothed[a]) and math.isfinite(smoothed[b])):
            continue
        slope = (smoothed[b] - smoothed[a]) / (x[b] - x[a])
        if slope < best_slope:
            steepest, best_slope = lrs[j], slope
    cyclic_max_lr = lrs[i_min] / MIN_LOSS_DIVISOR
    return dataclasses.replace(
        res,
        lr_steepest=steepest,
        suggested_lr=steepest if steepest is not None else lrs[i_min] / MIN_LOSS_DIVISOR,
        cyclic_max_lr=cyclic_max_lr,
        cyclic_base_lr=cyclic_max_lr * CYCLIC_BASE_RATIO,
    )
