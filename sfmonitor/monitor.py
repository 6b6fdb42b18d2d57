"""The Monitor: attach to any model and optimizer, watch every optimizer step, rescue the run.

Read ``Monitor._run_pipeline`` first: it is the whole per-step story, in this fixed order,

    1. stats      gather the step's statistics as tensors, read them to the host ONCE
    2. detectors  turn numbers into findings (they never touch the model)
    3. policy     turn findings into decisions (escalation, cooldowns, budgets)
    4. actions    the only code that changes training (skip, clip, reweight, lr drop, rollback...)
    5. sinks      every finding becomes an event with the actions it caused; metrics are logged

It runs where the *unscaled* gradients are ready and the update has not landed yet: in the
optimizer's step pre-hook, or, with a GradScaler, inside ``scaler.step`` right after ``unscale_``
(the scaler may skip ``optimizer.step`` and then no optimizer hook fires). ``_after_update`` runs in
the step post-hook (or after the scaler skipped) and measures what the update did.

Skipping a step: the pipeline hides every gradient (``p.grad = None``) before the optimizer runs.
torch.optim optimizers leave parameters without a gradient untouched (no state update, no step
counter), so parameters and optimizer state stay bit-identical; the gradients are put back after.
"""
from __future__ import annotations

import copy
import os
import time
import warnings
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from . import actions as A
from . import stats as S
from .checkpoint import SnapshotRing
from .config import MonitorConfig
from .detectors import build_detectors
from .events import (ACTIVATION_OVERFLOW, LOSS_RATIO_IMBALANCE, NONFINITE_GRAD, NONFINITE_LOSS,
                     NONFINITE_PARAM, PRECISION_FALLBACK, REWEIGHT, SKIP_STEP, ConfigError, Decision,
                     Event, Finding, NonFiniteError, StopTraining)
from .forensics import BatchRecorder, BundleTracker, batch_input_stats, load_manifest, write_bundle
from .integrations.distributed import rank, unwrap
from .policy import OCCURRENCE, Policy
from .sinks import SinkRouter, make_sink
from .sinks.console import ConsoleSink
from .watch import ActivationWatch

OTHER = "other"  # the group of parameters held by the root module or named by no group
NONFINITE_KINDS = (NONFINITE_LOSS, NONFINITE_GRAD, NONFINITE_PARAM)
ON_DEMAND = "on_demand"  # the kind of a bundle written because the user asked for one


def resolve_groups(model: nn.Module, groups: Mapping[str, Any] | None = None
                   ) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split the model's parameters into named groups.

    None: one group per top-level child module; parameters held by the root go to "other"; a tied
    weight belongs to the module ``named_parameters()`` lists first. A dict maps a group name to an
    ``nn.Module``, an iterable of Parameters, or a parameter-name prefix; parameters named by no
    group go to "other"; a parameter in two groups is an error.
    """
    model = unwrap(model)  # DDP / DataParallel: group by the wrapped model's own names
    named = list(model.named_parameters())  # de-duplicates tied weights: first name wins
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    if groups is None:
        children = {name for name, _ in model.named_children()}
        for name, p in named:
            head = name.split(".", 1)[0]
            out.setdefault(head if head in children and "." in name else OTHER, []).append((name, p))
        return out
    if not isinstance(groups, Mapping):
        raise ConfigError(f"groups: expected None or a dict {{name: module | parameters | prefix}}, "
                          f"got {type(groups).__name__}")
    by_id = {id(p): name for name, p in named}
    owner: dict[int, str] = {}
    for gname, spec in groups.items():
        if isinstance(spec, nn.Module):
            members = [id(p) for p in spec.parameters()]
        elif isinstance(spec, str):
            members = [id(p) for n, p in named if n == spec or n.startswith(spec.rstrip(".") + ".")]
            if not members:
                raise ConfigError(f"groups[{gname!r}]: prefix {spec!r} matches no parameter of the model")
        else:
            try:
                members = [id(p) for p in spec]
            except TypeError:
                raise ConfigError(f"groups[{gname!r}]: expected an nn.Module, an iterable of "
                                  f"Parameters or a name prefix, got {type(spec).__name__}") from None
        for pid in members:
            if pid not in by_id:
                raise ConfigError(f"groups[{gname!r}] holds a parameter that is not in the model")
            if pid in owner and owner[pid] != gname:
                raise ConfigError(f"parameter {by_id[pid]!r} is in two groups: "
                                  f"{owner[pid]!r} and {gname!r}")
            owner[pid] = gname
    for gname in groups:
        out[gname] = []
    for name, p in named:
        out.setdefault(owner.get(id(p), OTHER), []).append((name, p))
    return {g: ps for g, ps in out.items() if ps}


class _LossAccumulator:
    """Loss components recorded by ``combine()`` over the micro-batches of one optimizer step."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.total: torch.Tensor | None = None
        self.count = 0
        self.weights: dict[str, float] = {}

    def add(self, components: Mapping[str, torch.Tensor], total: torch.Tensor,
            weights: Mapping[str, float]) -> None:
        for k, v in components.items():
            v = v.detach().float()
            self.sums[k] = v if k not in self.sums else self.sums[k] + v
        t = total.detach().float()
        self.total = t if self.total is None else self.total + t
        self.count += 1
        self.weights = dict(weights)

    def tensors(self, pairs: list[list[str]]) -> dict[str, torch.Tensor | float]:
        if not self.count:
            return {}
        out: dict[str, torch.Tensor | float] = {S.LOSS_TOTAL: self.total / self.count}
        for k, v in self.sums.items():
            if k != "total":
                out[S.LOSS.format(k)] = v / self.count
        if len(self.sums) > 1:
            for k, w in self.weights.items():
                out[S.LOSS_WEIGHT.format(k)] = float(w)
            for a, b in S.pair_keys(self.sums, pairs):
                out[S.LOSS_RATIO.format(a, b)] = S.ratio(self.sums[a] / self.count, self.sums[b] / self.count)
        return out


class Monitor:
    """Watches a model and optimizer each optimizer step; see the module docstring.

    Args:
        config: a MonitorConfig, a dict, a path to a YAML file, or None for the defaults.
        run_dir: folder for metrics.jsonl, events.jsonl, checkpoints/, bundles/. None: a new
            folder under ./sfmonitor_runs/ is made on first write.
        sinks: sink names ("jsonl", "console", "tensorboard", "wandb") or Sink objects.
            Default: ["jsonl"] plus one console line per event (``config.console``).
    """

    def __init__(self, config: MonitorConfig | dict | str | os.PathLike | None = None,
                 run_dir: str | os.PathLike | None = None, sinks: Iterable[Any] | None = None):
        self.config = MonitorConfig.from_any(config)
        self.run_dir = os.fspath(run_dir) if run_dir is not None else None
        if isinstance(sinks, (str, bytes)):
            raise ConfigError(f"sinks: expected a list of sink names or objects, e.g. [{sinks!r}]")
        self._sink_specs = list(sinks) if sinks is not None else ["jsonl"]
        self.events: list[Event] = []
        self.step = 0
        self._should_stop = False
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler = None
        self.groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
        self._router: SinkRouter | None = None
        self._hooks: list[Any] = []
        self._undo: list[Any] = []  # callables that restore whatever attach() replaced
        self._losses = _LossAccumulator()
        self._base_weights: dict[str, float] = {}
        self._weights: dict[str, float] = {}  # current (possibly rescued) loss weights
        self._grad_ratio_tensors: dict[str, torch.Tensor] = {}
        self._stats: dict[str, float] = {}
        self._pending: dict[str, torch.Tensor] = {}  # after-update tensors of the last step
        self._pending_step: int | None = None
        self._amp_skipped = 0
        self._pipeline_done = False  # the pipeline already ran for the step in flight
        self._skipping = False
        self._hidden_grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._before_params: list[torch.Tensor] | None = None
        self._update_buf: list[torch.Tensor] | None = None  # reused copy of the parameters
        self._stepped = False
        self._scaler_skips = False  # the GradScaler found inf/NaN in this step's gradients
        self._external = False  # an integration calls before_update()/after_update()
        self._prev_record: tuple[int, dict[str, float]] | None = None  # for after-update detectors
        self._saved_lr: list[Any] = []
        self._model_factory: tuple[str, dict[str, Any]] | None = None
        # The stages. Detectors and policy hold windows, streaks and cooldowns (state_dict).
        self._detectors = build_detectors(self.config.detectors)
        self._policy = Policy(self.config.policy)
        self._watch = ActivationWatch(self.config.watch)
        self._recorder = BatchRecorder()
        self._bundles = BundleTracker(self.config.bundle)
        self._ctx: A.ActionContext | None = None  # built on attach: what actions may change
        self._pending_ctx: dict[str, Any] = {}  # action state loaded before attach()
        self._bundle_requested = False
        self.bundles: list[str] = []  # bundles written on request (anomaly bundles: in their events)

    # ------------------------------------------------------------------------------------------
    # attach / detach
    # ------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None,
               groups: Mapping[str, Any] | None = None) -> "Monitor":
        if self.model is not None:
            raise RuntimeError("this Monitor is already attached; call detach() first")
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach: model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("attach: LBFGS treats a missing gradient as zero, so a skipped step "
                            "could not be kept bit-identical; use a first-order optimizer")
        # Everything that can fail on bad input fails here, before any hook is registered.
        self.groups = resolve_groups(model, groups)
        sinks = [make_sink(s) for s in self._sink_specs]
        self.model, self.optimizer = model, optimizer
        # Parameters the optimizer updates but the model does not hold (a learnable temperature
        # in a loss module, say) are checked and skipped like the others, in group "other".
        in_model = {id(p) for _, p in unwrap(model).named_parameters()}
        extra = [(f"optimizer.param_groups[{gi}].params[{pi}]", p)
                 for gi, pg in enumerate(optimizer.param_groups) for pi, p in enumerate(pg["params"])
                 if id(p) not in in_model]
        if extra:
            self.groups.setdefault(OTHER, []).extend(extra)
        self._group_names = list(self.groups)
        self._name_to_group = {n: g for g, ps in self.groups.items() for n, _ in ps}
        group_index = {g: i for i, g in enumerate(self._group_names)}
        # Parameters in named_parameters() order, so "the first offending parameter" is the
        # first one a user (or `sfmonitor replay`) would find walking the model.
        ordered = [(n, p) for n, p in unwrap(model).named_parameters() if n in self._name_to_group] + extra
        self._params = [p for _, p in ordered]
        self._param_names = [n for n, _ in ordered]
        self._param_group = [group_index[self._name_to_group[n]] for n in self._param_names]
        device = self._params[0].device if self._params else torch.device("cpu")
        self._param_group_t = torch.tensor(self._param_group, dtype=torch.long).to(device)
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._hooks.append(optimizer.register_step_pre_hook(self._on_optimizer_pre_step))
        self._hooks.append(optimizer.register_step_post_hook(self._on_optimizer_post_step))
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            self.scaler = scaler
            self._wrap_scaler(scaler)
        rb = self.config.actions.rollback
        # Under torch.distributed every rank decides and acts alike, but only rank 0 writes
        # (logs, bundles, emergency checkpoints) into the shared run_dir.
        self._writer = rank() == 0
        self._ctx = A.ActionContext(
            model=unwrap(model), optimizer=optimizer, scaler=self.scaler, groups=self.groups,
            loss_weights=self._weights, base_weights=self._base_weights,
            snapshots=SnapshotRing(every=rb.snapshot_every, keep=rb.keep),
            run_dir=self._ensure_run_dir() if self._writer else None, config=self.config.actions,
            monitor_state=self.state_dict)
        self._watch.attach(unwrap(model))
        self._watch.reset(self.step)
        self._recorder.attach(model)
        self._undo.append(self._watch.detach)
        self._undo.append(self._recorder.detach)
        self._undo.append(lambda: A.remove_precision_fallback(self._ctx))
        if self._pending_ctx:  # load_state_dict() was called before attach()
            self.load_state_dict({**self.state_dict(), **self._pending_ctx})
        if self.config.console and not any(isinstance(s, ConsoleSink) for s in sinks):
            sinks.append(ConsoleSink())
        if not self._writer:
            sinks = []  # events stay in monitor.events on every rank
        self._router = SinkRouter(sinks)
        self._router.open(self._ensure_run_dir(), self.config.to_dict())
        return self

    def detach(self) -> None:
        """Remove every hook and restore what attach() replaced. Safe to call twice."""
        if self.model is None:
            return
        try:
            if self._pipeline_done:  # a step was interrupted: put gradients and LR back
                self._after_update(aborted=True)
            self._finish_pending()
        except Exception as e:  # noqa: BLE001 - detach must go on removing hooks; say what failed
            warnings.warn(f"sfmonitor: detach could not finish the last step ({type(e).__name__}: {e})",
                          RuntimeWarning, stacklevel=2)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if self._router is not None:
            self._router.flush()
            self._router.close()
            self._router = None
        # Drop every reference to the model, its state and copies of it (snapshots, the update
        # buffer); what the run learned (events, stats, state_dict()) stays.
        if self._ctx is not None:
            self._pending_ctx = {k: v for k, v in self.state_dict().items()
                                 if k in ("lr_scale", "batches_to_skip", "reweighted", "epoch")}
            self._should_stop = self.should_stop
        self._ctx = None
        self._update_buf = self._before_params = None
        self._params, self._index_cache, self.groups = [], {}, {}
        self.model = self.optimizer = self.scaler = None

    close = detach

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _ensure_run_dir(self) -> str:
        if self.run_dir is None:
            self.run_dir = os.path.join("sfmonitor_runs", time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
        return self.run_dir

    def _wrap_scaler(self, scaler: Any) -> None:
        """The one patch: GradScaler.step may skip optimizer.step, so no optimizer hook would fire.

        The step wrapper unscales first (as scaler.step would), runs the pipeline on the unscaled
        gradients, then calls the original. With ``actions.loss_scale.enforce_floor`` the update
        wrapper keeps the new scale >= ``min_loss_scale`` (a standing setting, no event).
        ``detach()`` puts both originals back.
        """
        original = scaler.step
        original_update = scaler.update
        monitor = self
        floor = self.config.actions.loss_scale

        def step(optimizer, *args, **kwargs):
            if optimizer is not monitor.optimizer or monitor.model is None:
                return original(optimizer, *args, **kwargs)
            from torch.amp.grad_scaler import OptState
            if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                scaler.unscale_(optimizer)
            if not monitor._pipeline_done:  # an integration may have run it already
                monitor._run_pipeline()
            monitor._stepped = False
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                if not monitor._stepped:  # the scaler found inf/NaN and skipped optimizer.step
                    monitor._after_update()

        def update(*args, **kwargs):
            out = original_update(*args, **kwargs)
            if floor.enforce_floor:
                A.keep_loss_scale_floor(scaler, floor.min_loss_scale)
            return out

        scaler.step, scaler.update = step, update
        self._undo.append(lambda: [scaler.__dict__.pop(name, None) for name in ("step", "update")])

    # ------------------------------------------------------------------------------------------
    # user API
    # ------------------------------------------------------------------------------------------
    def combine(self, losses: Mapping[str, torch.Tensor] | torch.Tensor,
                weights: Mapping[str, float] | None = None) -> torch.Tensor:
        """The weighted total of the loss components with the *current* weights; records them.

        ``weights`` are the base weights (default 1 each); a reweight rescue changes the current
        ones, and ``loss_weight/<c>`` shows them. Call once per micro-batch.
        """
        if isinstance(losses, torch.Tensor):
            self._losses.add({}, losses, {})
            return losses
        if not isinstance(losses, Mapping) or not losses:
            raise TypeError("combine: expected a non-empty dict {name: loss tensor} or a tensor")
        weights = dict(weights) if weights is not None else {k: 1.0 for k in losses}
        missing = set(losses) - set(weights)
        if missing:
            raise ConfigError(f"combine: no weight for loss component(s) {sorted(missing)}; "
                              f"weights has {sorted(weights)}")
        if {k: float(weights[k]) for k in losses} != self._base_weights:
            # New or changed base weights: rescues start over. Mutated in place: the action
            # context shares these dicts.
            self._base_weights.clear()
            self._base_weights.update({k: float(weights[k]) for k in losses})
            self._weights.clear()
            self._weights.update(self._base_weights)
        total = sum(self._weights[k] * v for k, v in losses.items())
        if self._losses.count == 0 and self._grad_ratio_due():
            self._grad_ratio_tensors = self._component_grad_stats(losses)
        self._losses.add(losses, total, self._weights)
        return total

    def _grad_ratio_due(self) -> bool:
        every = self.config.stats.grad_ratio_every
        return bool(every) and self.model is not None and self.step % every == 0 and torch.is_grad_enabled()

    def _component_grad_stats(self, losses: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """grad_ratio/<a>/<b> and grad_cos/<a>/<b> on the parameters both components reach.

        One extra backward per component (autograd.grad, graph retained), on the first
        micro-batch of every ``grad_ratio_every``-th step; ``.grad`` is not touched.
        """
        pairs = S.pair_keys([k for k, v in losses.items() if v.requires_grad], self.config.stats.loss_ratio_pairs)
        if not pairs:
            return {}
        if self.config.stats.grad_ratio_groups:
            params = [p for g in self.config.stats.grad_ratio_groups for _, p in self.groups.get(g, [])]
        else:
            params = [p for p in self._params if p.requires_grad]
        comps = sorted({c for pair in pairs for c in pair})
        grads = {c: torch.autograd.grad(losses[c], params, retain_graph=True, allow_unused=True) for c in comps}
        out = {}
        for a, b in pairs:
            r = S.shared_grad_stats(grads[a], grads[b])
            if r is not None:
                out[S.GRAD_RATIO.format(a, b)], out[S.GRAD_COS.format(a, b)] = r
        return out

    @property
    def stats(self) -> dict[str, float]:
        """The last optimizer step's statistics. Reading it right after a step forces the read of
        that step's update ratio (a host sync the monitor would otherwise do on the next step)."""
        self._finish_pending()
        return dict(self._stats)

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the loader's batches, leaving out those a rollback asked to skip."""
        for batch in loader:
            if self._ctx is not None and self._ctx.batches_to_skip > 0:
                self._ctx.batches_to_skip -= 1
                continue
            yield batch

    @property
    def should_stop(self) -> bool:
        """True once the policy decided to stop (early stopping, or a spent rescue budget)."""
        return self._should_stop or (self._ctx is not None and self._ctx.should_stop)

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._should_stop = bool(value)
        if self._ctx is not None:
            self._ctx.should_stop = bool(value)

    def set_model_factory(self, factory: str, **kwargs: Any) -> None:
        """How ``sfmonitor replay`` rebuilds the model from a bundle: "module:function" and its
        JSON-able keyword arguments (the reference trainer sets this)."""
        if not isinstance(factory, str) or ":" not in factory:
            raise ConfigError(f"model factory must be 'module:function', got {factory!r}")
        self._model_factory = (factory, dict(kwargs))

    def observe_eval(self, metrics: Mapping[str, float], chance: float | None = None) -> list[Event]:
        """Feed validation results to the evaluation detectors (accuracy collapse, plateau);
        their findings go through the same policy and actions. Returns the new events."""
        if self.model is None:
            raise RuntimeError("observe_eval: the monitor is not attached (call attach() first); "
                               "its actions would have no model to act on")
        values = {k: float(v) for k, v in metrics.items()}
        self._ctx.epoch += 1  # validations mark epochs (the gradient-noise decay counts them)
        findings = [f for d in self._detectors for f in d.observe_eval(self.step, values, chance)]
        return self._decide_and_act(self.step, findings, during_step=False)

    # ------------------------------------------------------------------------------------------
    # hooks
    # ------------------------------------------------------------------------------------------
    def _on_optimizer_pre_step(self, optimizer, args, kwargs) -> None:
        # With a scaler the pipeline already ran inside scaler.step; driven externally, the
        # framework calls before_update() where its gradients are ready.
        if self.scaler is None and not self._external and not self._pipeline_done:
            self._run_pipeline()
        self._stepped = True

    # ------------------------------------------------------------------------------------------
    # integrations (Lightning, transformers): frameworks that call optimizer.step(closure)
    # ------------------------------------------------------------------------------------------
    def drive_externally(self) -> "Monitor":
        """Let a framework tell the monitor where the unscaled gradients are ready.

        Lightning calls ``optimizer.step(closure)``: the optimizer pre-hook fires before the closure
        has computed any gradient. An integration calls this once after attach, then
        ``before_update()`` from the framework's hook that runs after backward (and after
        unscaling) and before the update, and ``after_update()`` once the step is over (it is a
        no-op when the optimizer post-hook already finished the step).
        """
        self._external = True
        return self

    def before_update(self) -> None:
        """Run the pipeline for the step in flight (integrations; see ``drive_externally``)."""
        if self.model is not None and not self._pipeline_done:
            self._run_pipeline()

    def after_update(self) -> None:
        """Finish the step in flight if the optimizer post-hook did not (e.g. a skipped AMP step)."""
        if self.model is not None:
            self._after_update()

    def _on_optimizer_post_step(self, optimizer, args, kwargs) -> None:
        self._after_update()

    # ------------------------------------------------------------------------------------------
    # the per-step pipeline
    # ------------------------------------------------------------------------------------------
    def _run_pipeline(self) -> None:
        """Everything the monitor does before an update lands, in this fixed order."""
        step = self.step

        # 1. stats: every number of this step as a tensor, then ONE host read. The previous
        #    step's update ratios (measured after its update landed) ride along in the same read.
        tensors, per_param = self._collect_tensors([p.grad for p in self._params])
        tensors.update(self._watch.pending())
        prev = {f"prev:{k}": v for k, v in self._pending.items()}
        values = S.read_all({**tensors, **prev})  # the step's single host synchronisation
        self._complete_previous({k[len("prev:"):]: values.pop(k) for k in prev})
        stats = {k: v for k, v in values.items() if not k.startswith("_")}
        # The scaler will skip this very step (itself, or inside a fused optimizer): count it in
        # this step's record and in the running total.
        self._scaler_skips = values.get("_amp_found_inf", 0.0) > 0
        if self._scaler_skips:
            stats[S.AMP_SKIPPED] += 1
        self._stats = stats

        # 2. detectors: the core's non-finite checks; the configured detectors (after-update ones
        #    judge the update the previous step landed); the activation watch.
        findings = self._nonfinite_findings(step, values, per_param)
        if self._prev_record is not None:
            prev_step, prev_stats = self._prev_record
            findings += [f for d in self._detectors if d.after_update for f in d.check(prev_step, prev_stats)]
            self._prev_record = None
        findings += [f for d in self._detectors if not d.after_update for f in d.check(step, stats)]
        findings += self._watch_findings(step, values)

        # A healthy step starts from a good state to come back to: snapshot it, at the first
        # healthy step once `snapshot_every` steps have passed since the last snapshot.
        if all(f.data.get("skipped_by") == "grad_scaler" for f in findings):
            self._ctx.snapshots.maybe_take(step, self.model, self.optimizer, self.scaler, {"step": step})

        if self._bundle_requested and self._writer:  # request_bundle(): this step, as it is now
            self._bundle_requested = False
            self.bundles.append(self._write_bundle(step, ON_DEMAND, {"step": step, "kind": ON_DEMAND,
                                                                     "message": "requested by the user"}))

        # 3. policy, 4. actions, 5. sinks (events): shared with observe_eval(). The step counts
        # as in flight from here, so an interrupted one (StopTraining) is finished by detach().
        self._pipeline_done = True
        self._decide_and_act(step, findings, during_step=True)

    def _decide_and_act(self, step: int, findings: list[Finding], during_step: bool) -> list[Event]:
        """Stages 3-5 for a list of findings: policy -> actions -> one event per finding."""
        ctx = self._ctx
        # The scaler's own skips (finite loss, overflowing scaled gradients) are ordinary dynamic
        # loss scaling: recorded as events, never acted on.
        actionable = [f for f in findings if f.data.get("skipped_by") != "grad_scaler"]
        nonfinite = [f for f in actionable if f.kind in (NONFINITE_LOSS, NONFINITE_GRAD)]
        if nonfinite and self.config.strict:
            events = [self._emit(Event(step, f.kind, f.message, dict(f.data), [])) for f in findings]
            if during_step:
                self._after_update(aborted=True)
            raise NonFiniteError(f"step {step}: {nonfinite[0].message}", events[0])
        # 3. policy: findings -> decisions (ladders, cooldowns, budget).
        decisions = self._policy.decide(step, actionable)
        if during_step and nonfinite and not any(d.action == SKIP_STEP for d in decisions):
            # The promise holds whatever the ladder says: a non-finite step never lands.
            decisions.insert(0, Decision(SKIP_STEP, nonfinite[0], {"enforced": True}))
        # Evidence for the anomalies (non-finite values, findings that trigger actions), taken
        # before any action changes the state; warnings that trigger nothing cost nothing here.
        causes = {id(d.cause) for d in decisions}
        anomalies = [f for f in actionable if id(f) in causes or f.kind in NONFINITE_KINDS]
        if during_step and anomalies:
            self._gather_evidence(step, anomalies)

        # 4. actions: the only code that changes training.
        ctx.step, ctx.stats = step, self._stats
        taken: dict[int, list[str]] = {id(f): [] for f in findings}
        results: dict[int, dict[str, Any]] = {id(f): {} for f in findings}
        stop_error: StopTraining | None = None
        stop_cause: Finding | None = None
        for d in decisions:
            try:
                facts = A.apply(ctx, d)
            except StopTraining as e:
                facts, stop_error, stop_cause = getattr(e, "facts", {"reason": str(e)}), e, d.cause
            taken[id(d.cause)].append(d.action)
            results[id(d.cause)][d.action] = facts
            if "streak" in d.params:  # why this rung: how many times the kind came, how close
                d.cause.data.setdefault("policy", {"streak": d.params["streak"], "rung": d.params.get("rung_after")})
            if stop_error is not None:
                break
        if during_step:
            if ctx.skip:
                self._skip_current_step()
            relaxed = A.relax_weights(ctx)
            if relaxed.get("restored"):
                findings.append(Finding(
                    LOSS_RATIO_IMBALANCE, f"loss ratio back under its threshold: weights restored to their "
                                   f"base {self._base_weights}", {"restored": relaxed["restored"]}))
                taken[id(findings[-1])] = [REWEIGHT]
                results[id(findings[-1])] = {REWEIGHT: relaxed}
            # The LR scale (lr_drop) applies around this update only; the user's own LR and
            # scheduler are put back after it (see actions.py).
            self._saved_lr = A.apply_lr_scale(self.optimizer, ctx.lr_scale, self.config.actions.lr_drop.min_lr)
            for i, pg in enumerate(self.optimizer.param_groups):
                self._stats[S.LR.format(i)] = float(pg["lr"])
        ctx.skip = False

        # 5. sinks: one event per finding, with the actions it caused and what they did.
        suppressed = self._policy.suppressed
        events = []
        for f in findings:
            data = dict(f.data)
            if results[id(f)]:
                data["action_results"] = results[id(f)]
            held = [s for s in suppressed if s["kind"] == f.kind]
            if held:
                data["suppressed"] = held
            if during_step and self._skipping and f.kind in NONFINITE_KINDS and not taken[id(f)]:
                data["step_skipped"] = True  # by another finding's skip_step in this same step
            # A finding about an update that already landed names the step of that update.
            at = step if f.before_update else int(f.data.get("step", step))
            events.append(self._emit(Event(at, f.kind, f.message, data, taken[id(f)])))
        if stop_error is not None:
            stop_error.event = events[[id(f) for f in findings].index(id(stop_cause))]
            if during_step:  # the update never lands; gradients and LR go back now
                self._after_update(aborted=True)
            raise stop_error
        return events

    def _watch_findings(self, step: int, values: dict[str, float]) -> list[Finding]:
        """activation_overflow findings. A module that actually produced inf/NaN has overflowed
        for real: its finding enters the ladder at the precision_fallback rung at once."""
        if not self._watch.attached:
            return []
        found = self._watch.findings(step, values)
        ladder = self.config.policy.ladders.get(ACTIVATION_OVERFLOW)
        fallback_at = next((r.after for r in ladder.rungs if PRECISION_FALLBACK in r.actions), None) if ladder else None
        for f in found:
            if f.data.get("recommend") == PRECISION_FALLBACK and fallback_at is not None:
                f.data[OCCURRENCE] = fallback_at
        return found

    def _gather_evidence(self, step: int, findings: list[Finding]) -> None:
        """The playbook: per-input statistics of the step's batch on every anomaly, and one anomaly
        bundle (pre-step state, batch, stats, RNG, config) for the step where a kind first shows."""
        inputs = batch_input_stats(self._recorder.batches)
        for f in findings:
            f.data.setdefault("inputs", inputs)
        new = [f for f in findings if f.before_update and self._bundles.should_write(f.kind)]
        if not new or not self._writer:
            return
        first = new[0]
        try:
            path = self._write_bundle(step, first.kind, {"step": step, "kind": first.kind, "message": first.message,
                                                         "data": first.data, "where": first.where})
        except Exception as e:  # noqa: BLE001 - evidence must never stop training
            first.data["bundle_error"] = f"{type(e).__name__}: {e}"
            return
        dropped = load_manifest(path).get("batch_dropped_reason")
        for f in new:  # one bundle serves every finding of the step
            self._bundles.mark(f.kind, step)
            f.data["bundle"] = path
            if dropped:
                f.data["bundle_batch_dropped"] = dropped

    def _write_bundle(self, step: int, kind: str, event: dict[str, Any]) -> str:
        factory, kwargs = self._model_factory or (None, None)
        cfg = self.config.bundle
        return write_bundle(
            self._ensure_run_dir(), step, kind, model_state=unwrap(self.model).state_dict(),
            optimizer_state=self.optimizer.state_dict(), batch=self._recorder.batches,
            stats=self._stats, event=event, rng_state=self._recorder.rng_state,
            config=self.config.to_dict(), model_factory=factory, model_kwargs=kwargs,
            loss_weights=dict(self._weights), max_bytes=int(cfg.max_mb * 2 ** 20), dir_name=cfg.dir)

    def request_bundle(self) -> None:
        """Write an anomaly bundle of the next optimizer step (its pre-step state and batch), as
        if something had gone wrong there: for reproducing a step by hand with `sfmonitor replay`.
        Its path lands in ``monitor.bundles``. Needs ``bundle.on_demand`` (default true)."""
        if not self._bundles.should_write(ON_DEMAND, on_demand=True):
            raise ConfigError("request_bundle: bundle.on_demand is false (or bundle.enabled is false)")
        self._bundle_requested = True

    def _collect_tensors(self, grads: list[torch.Tensor | None]) -> tuple[dict[str, Any], dict[str, Any]]:
        """All statistics of the step as 0-d tensors (or Python numbers); nothing is read here."""
        out: dict[str, Any] = {}
        out.update(self._losses.tensors(self.config.stats.loss_ratio_pairs))
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        grad_norms = S.norms([g for _, g in present])
        key = tuple(i for i, _ in present)  # which parameters have gradients: stable across steps
        if key not in self._index_cache:  # group index tensors are built once, not copied per step
            self._index_cache[key] = torch.tensor([self._param_group[i] for i in key]).to(grad_norms.device)
        per_group = S.group_norms(grad_norms, self._index_cache[key], len(self._group_names))
        out[S.GRAD_NORM_TOTAL] = per_group.square().sum().sqrt()
        for gi, g in enumerate(self._group_names):
            out[S.GRAD_NORM.format(g)] = per_group[gi]
        params = [p.detach() for p in self._params]
        param_norms = S.norms(params)
        per_group_p = S.group_norms(param_norms, self._param_group_t, len(self._group_names))
        for gi, g in enumerate(self._group_names):
            out[S.PARAM_NORM.format(g)] = per_group_p[gi]
        for i, pg in enumerate(self.optimizer.param_groups):
            lr = pg["lr"]
            out[S.LR.format(i)] = lr if isinstance(lr, torch.Tensor) else float(lr)
        out.update(self._grad_ratio_tensors)
        if self.scaler is not None:
            scale = self.scaler._scale
            out[S.AMP_LOSS_SCALE] = scale if scale is not None else float(self.scaler.get_scale())
            out[S.AMP_SKIPPED] = float(self._amp_skipped)
            found = self.scaler._per_optimizer_states[id(self.optimizer)].get("found_inf_per_device", {})
            if found:
                out["_amp_found_inf"] = sum(v.to(next(iter(found.values())).device) for v in found.values())
        # Which gradients / parameters are non-finite: first index, count (resolved at the read).
        bad_grad = ~torch.isfinite(grad_norms)
        out["_local/grad_first_bad"] = S.first_true(bad_grad)
        out["_grad_bad_count"] = bad_grad.sum()
        bad_param = ~torch.isfinite(param_norms)
        out["_local/param_first_bad"] = S.first_true(bad_param)
        out["_param_bad_count"] = bad_param.sum()
        per_param = {"grad_index": [i for i, _ in present]}
        if self.config.stats.update_ratio_every and self.step % self.config.stats.update_ratio_every == 0:
            # One buffer per parameter, allocated once and reused: copying into warm memory is
            # several times cheaper than a fresh clone each step.
            if self._update_buf is None:
                self._update_buf = [torch.empty_like(p, memory_format=torch.preserve_format) for p in self._params]
            torch._foreach_copy_(self._update_buf, params)
            self._before_params = self._update_buf
            self._before_norms = per_group_p
        return out, per_param

    def _nonfinite_findings(self, step: int, v: dict[str, float], per_param: dict[str, Any]) -> list[Finding]:
        findings: list[Finding] = []
        scaler_skips = v.get("_amp_found_inf", 0.0) > 0
        loss = v.get(S.LOSS_TOTAL)
        if loss is not None and not S.finite(loss):
            comps = {k[5:]: x for k, x in v.items() if k.startswith("loss/") and k != S.LOSS_TOTAL}
            bad = [c for c, x in comps.items() if not S.finite(x)]
            findings.append(Finding(NONFINITE_LOSS,
                                    f"loss is {loss}" + (f" (non-finite components: {', '.join(bad)})" if bad else ""),
                                    {"loss": loss, "components": comps, "nonfinite_components": bad}))
        if v["_grad_bad_count"] > 0:
            first = int(v["_local/grad_first_bad"])  # -1: the bad values were on another rank
            name = self._param_names[per_param["grad_index"][first]] if first >= 0 else "(another rank)"
            n_bad = int(v["_grad_bad_count"])
            data = {"param": name, "group": self._name_to_group.get(name, "?"), "count": n_bad,
                    "grad_norm": v[S.GRAD_NORM_TOTAL]}
            msg = (f"non-finite gradient in {name} (group {data['group']}); "
                   f"{n_bad} parameter(s) with non-finite gradients")
            if scaler_skips and not findings:
                # Finite loss, overflowing scaled gradients: ordinary dynamic loss scaling.
                data["skipped_by"] = "grad_scaler"
                scale = v.get(S.AMP_LOSS_SCALE)
                msg += f"; the GradScaler skips this step and lowers its scale from {scale:g}"
            findings.append(Finding(NONFINITE_GRAD, msg, data, where=name))
        elif scaler_skips and not findings:
            findings.append(Finding(NONFINITE_GRAD, "the GradScaler found inf/NaN gradients and skips this step",
                                    {"skipped_by": "grad_scaler"}))
        if v["_param_bad_count"] > 0:
            first = int(v["_local/param_first_bad"])
            name = self._param_names[first] if first >= 0 else "(another rank)"
            group = self._name_to_group.get(name, "?")
            findings.append(Finding(NONFINITE_PARAM, f"non-finite parameter {name} (group {group})",
                                    {"param": name, "group": group,
                                     "count": int(v["_param_bad_count"])}, where=name))
        return findings

    def _skip_current_step(self) -> None:
        """Hide every gradient so the optimizer leaves parameters and state untouched."""
        if self._skipping:
            return
        self._skipping = True
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self._hidden_grads.append((p, p.grad))
                p.grad = None

    def _after_update(self, aborted: bool = False) -> None:
        """After the optimizer ran (or was skipped): restore hidden grads, measure the update.
        ``aborted``: the step was interrupted by an exception (strict mode, StopTraining); no
        update landed, and the next step must run the pipeline again if the user carries on."""
        if not self._pipeline_done:
            return
        skipped = aborted or self._skipping or not self._stepped or self._scaler_skips
        for p, g in self._hidden_grads:
            p.grad = g
        self._hidden_grads.clear()
        A.restore_lr(self.optimizer, self._saved_lr)  # the user's LR and scheduler, untouched
        self._saved_lr = []
        if self._scaler_skips and not aborted:
            self._amp_skipped += 1
        if self._before_params is not None:
            if not skipped:
                upd = S.update_norms_(self._before_params, [p.detach() for p in self._params])
                per_group = S.group_norms(upd, self._param_group_t, len(self._group_names))
                for gi, g in enumerate(self._group_names):
                    self._pending[S.UPDATE_RATIO.format(g)] = per_group[gi] / self._before_norms[gi].clamp_min(1e-12)
            else:
                for g in self._group_names:
                    self._pending[S.UPDATE_RATIO.format(g)] = torch.zeros(())
            self._before_params = None
        self._pending_step = self.step
        if not self._pending:
            self._complete_previous({})
        # Reset per-step state; the step counter counts skipped steps too. After a non-finite
        # loss the watch samples the next step whatever its stride.
        if not S.finite(self._stats.get(S.LOSS_TOTAL, 0.0)):
            self._watch.sample_next()
        self._watch.reset(self.step + 1)
        self._recorder.clear()
        self._losses = _LossAccumulator()
        self._grad_ratio_tensors = {}
        self._skipping = False
        self._stepped = False
        self._scaler_skips = False
        self._pipeline_done = False
        self.step += 1

    def _finish_pending(self) -> None:
        """Read the pending after-update tensors now (used by ``stats`` and ``detach``)."""
        if self._pending_step is not None:
            # Local: one rank may read monitor.stats alone (e.g. to log on rank 0), so no
            # collective here; the update ratios are the same on every rank anyway.
            self._complete_previous(S.read_all(self._pending, agree=False))

    def _complete_previous(self, values: dict[str, float]) -> None:
        """The last step's record is complete: add its update ratios and send it to the sinks."""
        if self._pending_step is None:
            return
        self._stats.update(values)
        step = self._pending_step
        self._pending = {}
        self._pending_step = None
        self._prev_record = (step, dict(self._stats))  # for the after-update detectors
        if self._router is not None:
            self._router.log_metrics(step, dict(self._stats))

    def _emit(self, event: Event) -> Event:
        self.events.append(event)
        if self._router is not None:
            self._router.log_event(event)
        return event

    # ------------------------------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: step, loss weights, LR scale, detector windows, policy streaks and
        cooldowns, watch streaks, bundles written. Snapshots and hooks are not included."""
        ctx = self._ctx
        return {
            "step": self.step, "amp_skipped": self._amp_skipped, "should_stop": self.should_stop,
            "base_weights": dict(self._base_weights), "weights": dict(self._weights),
            "lr_scale": ctx.lr_scale if ctx else self._pending_ctx.get("lr_scale", 1.0),
            "batches_to_skip": ctx.batches_to_skip if ctx else self._pending_ctx.get("batches_to_skip", 0),
            "reweighted": copy.deepcopy(ctx.reweighted) if ctx else self._pending_ctx.get("reweighted", {}),
            "fp32_modules": list(ctx.fp32_modules) if ctx else self._pending_ctx.get("fp32_modules", []),
            "detectors": [d.state_dict() for d in self._detectors],
            "policy": self._policy.state_dict(),
            "watch": self._watch.state_dict(),
            "bundles": self._bundles.state_dict(),
            "epoch": ctx.epoch if ctx else self._pending_ctx.get("epoch", 0),
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; works before or after ``attach``."""
        self.step = int(sd["step"])
        self._amp_skipped = int(sd.get("amp_skipped", 0))
        self._base_weights.clear()
        self._base_weights.update(sd.get("base_weights", {}))
        self._weights.clear()
        self._weights.update(sd.get("weights", {}))
        dets = sd.get("detectors", [])
        if dets and len(dets) != len(self._detectors):
            raise ConfigError(f"state_dict has {len(dets)} detector states, this monitor has "
                              f"{len(self._detectors)} detectors (different detectors config)")
        for d, st in zip(self._detectors, dets):
            d.load_state_dict(st)
        self._policy.load_state_dict(sd.get("policy", {}))
        self._watch.load_state_dict(sd.get("watch", {}))
        self._bundles.load_state_dict(sd.get("bundles", {}))
        self._pending_ctx = {k: sd[k] for k in ("lr_scale", "batches_to_skip", "reweighted", "fp32_modules", "epoch")
                             if k in sd}
        self.should_stop = bool(sd.get("should_stop", False))
        if self._ctx is not None:
            ctx = self._ctx
            ctx.lr_scale = float(sd.get("lr_scale", 1.0))
            ctx.batches_to_skip = int(sd.get("batches_to_skip", 0))
            ctx.reweighted = copy.deepcopy(dict(sd.get("reweighted", {})))
            ctx.epoch = int(sd.get("epoch", 0))
            for name in sd.get("fp32_modules", []):
                if name not in ctx.fp32_modules:
                    A.precision_fallback(ctx, Decision(PRECISION_FALLBACK, Finding(ACTIVATION_OVERFLOW, "restored"),
                                                       {"module": name}))
            self._pending_ctx = {}


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None,
           groups: Mapping[str, Any] | None = None, **monitor_kwargs: Any) -> Monitor:
    """Shortcut: ``Monitor(**monitor_kwargs).attach(model, optimizer, scaler=scaler, groups=groups)``."""
    return Monitor(**monitor_kwargs).attach(model, optimizer, scaler=scaler, groups=groups)
