"""``sfmonitor replay BUNDLE [--model module:factory] [--ablate]``: rerun an anomaly bundle.

Rebuilds the model (the bundle's factory is trusted only when an installed package registers it
under the entry point group ``sfmonitor.replay_factories``; any other factory must be named with
``--model``, since importing what a file names runs code), loads the pre-step state,
reruns forward and backward on the saved micro-batches under the recorded autocast dtype and loss
scale, with the RNG state of the step restored, and reports:

* whether the anomaly reproduces (non-finite loss / gradient, overflowing module, or the same loss);
* the first module, in forward order, that produced inf/NaN (``ActivationWatch`` on every module,
  inline matmul/softmax results included) and the first parameter, in ``named_parameters`` order,
  with a non-finite gradient;
* with ``--ablate`` (the report's playbook: disable loss components one at a time): for each loss
  component, whether the gradient is non-finite with that component alone and without it.

Exit status: 0 reproduced, 1 ran but did not reproduce, 2 bad bundle or arguments.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import torch
from torch import nn

from .events import ACTIVATION_OVERFLOW, BAD_BATCH, NONFINITE_GRAD, NONFINITE_LOSS, jsonable
from .forensics import BundleError, load_bundle, restore_rng_state
from .watch import ActivationWatch, WatchConfig

__all__ = [
    "FACTORY_GROUP",
    "first_nonfinite_param",
    "main",
    "replay_bundle",
    "resolve_factory",
    "trusted_factories",
]

LIVE_PARAM_KEYS = ("param", "parameter", "first_param", "name")
# Model factories a bundle may name: a package lists its own in its pyproject.toml,
#   [project.entry-points."sfmonitor.replay_factories"]
#   mymodel = "mypackage.model:build_model"
# A bundle is a file anyone can write; installing a package is the user's own decision. So replay
# imports what a bundle names only when it is one of these values, compared as exact strings.
FACTORY_GROUP = "sfmonitor.replay_factories"


def trusted_factories() -> set[str]:
    """The "module:function" factories registered under ``sfmonitor.replay_factories``."""
    return {f"{ep.module}:{ep.attr}" for ep in entry_points(group=FACTORY_GROUP) if ep.attr}


def resolve_factory(spec: str | Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A callable, or ``"package.module:function"`` imported."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise BundleError(f"model factory must be 'module:function', got {spec!r}")
    mod_name, fn_name = spec.split(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise BundleError(f"cannot import {mod_name!r} for model factory {spec!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise BundleError(f"model factory {spec!r}: {mod_name} has no callable {fn_name!r}")
    return fn


def first_nonfinite_param(model: nn.Module) -> str | None:
    """Name of the first parameter (``named_parameters`` order) whose gradient holds inf/NaN.

    One host read for all parameters.
    """
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return None
    bad = torch.stack([~torch.isfinite(g).all() for _, g in named]).tolist()
    for (n, _), b in zip(named, bad):
        if b:
            return n
    return None


def _losses(out: Any, weights: dict[str, float]) -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return {"total": out}
    if isinstance(out, (tuple, list)):  # nanoGPT's (logits, loss): the one scalar tensor is the loss
        scalars = [v for v in out if isinstance(v, torch.Tensor) and v.dim() == 0]
        if len(scalars) == 1:
            return {"total": scalars[0]}
    if isinstance(out, dict):
        comps = {
            k: v
            for k, v in out.items()
            if isinstance(v, torch.Tensor) and v.dim() == 0 and (not weights or k in weights)
        }
        if comps:
            return comps
    got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
    raise BundleError(
        f"the model's forward must return a 0-d loss tensor, a dict of 0-d loss tensors or a tuple holding "
        f"one 0-d loss (as nanoGPT's (logits, loss)), or pass --loss module:function to compute the loss "
        f"from its output (function(output, batch) -> loss); got {got}"
    )


def _run(
    model: nn.Module, bundle: dict[str, Any], *, keep: set[str] | None, loss: Callable[..., Any] | None = None
) -> dict[str, Any]:
    """One forward/backward over every saved micro-batch; ``keep``: components summed (None: all)."""
    manifest = bundle["manifest"]
    weights = manifest.get("loss_weights") or {}
    stats = bundle.get("stats") or {}
    scale = float(stats.get("amp/loss_scale", 1.0) or 1.0)
    if not math.isfinite(scale) or scale <= 0:
        scale = 1.0
    model.zero_grad(set_to_none=True)
    if bundle.get("rng_state"):
        restore_rng_state(bundle["rng_state"])
    watch = ActivationWatch(WatchConfig(stride=1, modules=["*"], classes=[])).attach(model)
    losses: dict[str, list[float]] = {}
    try:
        watch.reset(0)
        for mb in bundle["batch"]:
            args, kwargs = list(mb.get("args", ())), dict(mb.get("kwargs", {}))
            amp = mb.get("autocast")
            dev = mb.get("device", "cpu")
            ctx = (
                torch.autocast(device_type=dev, dtype=getattr(torch, amp))
                if amp
                else torch.autocast(device_type=dev, enabled=False)
            )
            with ctx:
                out = model(*args, **kwargs)
                comps = _losses(loss(out, {"args": args, "kwargs": kwargs}) if loss else out, weights)
            for k, v in comps.items():
                losses.setdefault(k, []).append(float(v.detach().float()))
            chosen = [k for k in comps if keep is None or k in keep]
            if not chosen:
                continue
            total = sum(float(weights.get(k, 1.0)) * comps[k].float() for k in chosen)
            assert isinstance(total, torch.Tensor)  # chosen is not empty: 0 + a tensor is a tensor
            if total.requires_grad:
                (total * scale).backward()
        act = {k: float(v) for k, v in watch.pending().items()}
        findings = watch.findings(0, act)
    finally:
        watch.detach()
    param = first_nonfinite_param(model)
    first_module = next((f.data["module"] for f in findings if f.data.get("nonfinite")), None)
    used = [k for k in losses if keep is None or k in keep]
    return {
        "losses": losses,
        "loss_nonfinite": any(not math.isfinite(v) for k in used for v in losses[k]),
        "grad_nonfinite": param is not None,
        "first_nonfinite_param": param,
        "first_nonfinite_module": first_module,
        "overflow_warnings": [f.data["module"] for f in findings if not f.data.get("nonfinite")],
        "act_absmax": {k: v for k, v in act.items() if k.startswith("act_absmax/")},
    }


def _live_param(event: dict[str, Any] | None) -> str | None:
    data = (event or {}).get("data") or {}
    if isinstance(data.get(NONFINITE_GRAD), dict):  # a bad batch: its gradient symptom names it
        data = {**data, **data[NONFINITE_GRAD]}
    for key in LIVE_PARAM_KEYS:
        if isinstance(data.get(key), str):
            return data[key]
    return None


def replay_bundle(
    path: str,
    factory: str | Callable[..., nn.Module] | None = None,
    ablate: bool = False,
    loss: str | Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Replay a bundle; return the report as a dict (see the module doc).

    ``factory``: a callable or "module:function" building the model from the bundle's
    ``model_kwargs``; None: the bundle's factory, trusted only when an installed package registers
    it under the entry point group ``sfmonitor.replay_factories`` (``trusted_factories()``).
    ``loss``: a callable or "module:function" ``(output, {"args", "kwargs"}) -> loss tensor or dict``
    for models whose forward does not return the loss.
    """
    loss_fn = resolve_factory(loss) if loss is not None else None
    bundle = load_bundle(path)
    manifest = bundle["manifest"]
    if bundle["batch"] is None:
        why = manifest.get("batch_dropped_reason") or (manifest.get("dropped") or {}).get("batch") or "none was saved"
        raise BundleError(f"{path}: the bundle holds no batch to replay ({why})")
    if factory is None:
        named = manifest.get("model_factory")
        trusted = trusted_factories()
        if not isinstance(named, str) or named not in trusted:
            listed = ", ".join(sorted(trusted)) or "none installed"
            if named is None:
                raise BundleError(
                    f"{path}: the bundle names no model factory (the run never called "
                    "monitor.set_model_factory('module:function')): pass --model module:function, a "
                    "function that builds the model (and --loss module:function if its forward "
                    "does not return the loss)"
                )
            raise BundleError(
                f"{path}: the bundle names model factory {named!r}; only the factories "
                f"installed packages register under {FACTORY_GROUP!r} ({listed}) are "
                f"trusted from a file -- pass --model {named} to use it"
            )
        factory = named
    build = resolve_factory(factory)
    kwargs = manifest.get("model_kwargs") or {}
    try:
        model = build(**kwargs)
    except TypeError as e:
        raise BundleError(f"model factory {factory!r} rejected model_kwargs {kwargs!r}: {e}") from e
    if not isinstance(model, nn.Module):
        raise BundleError(f"model factory {factory!r} returned {type(model).__name__}, not an nn.Module")
    try:
        model.load_state_dict(bundle["model_state"], strict=True)
    except RuntimeError as e:
        raise BundleError(
            f"the bundle's model state does not fit the model built by {factory!r}: {str(e).splitlines()[0]}"
        ) from e
    model.train()

    kind = manifest.get("kind")
    event = bundle.get("event") or {}
    run = _run(model, bundle, keep=None, loss=loss_fn)
    if kind in (NONFINITE_LOSS, BAD_BATCH):  # a bad batch shows as a non-finite loss
        reproduced: bool | None = run["loss_nonfinite"]
    elif kind == NONFINITE_GRAD:
        reproduced = run["grad_nonfinite"]
    elif kind == ACTIVATION_OVERFLOW:
        live_module = (event.get("data") or {}).get("module")
        seen = ([run["first_nonfinite_module"]] if run["first_nonfinite_module"] else []) + run["overflow_warnings"]
        reproduced = live_module in seen if live_module else bool(seen)
    else:
        live_total = (bundle.get("stats") or {}).get("loss/total")
        if isinstance(live_total, (int, float)) and run["losses"]:
            weights = manifest.get("loss_weights") or {}
            total = sum(float(weights.get(k, 1.0)) * v for k, vs in run["losses"].items() for v in vs)
            n = max(1, int(manifest.get("micro_batches") or 1))
            reproduced = bool(
                math.isclose(total / n, live_total, rel_tol=1e-3) or math.isclose(total, live_total, rel_tol=1e-3)
            )
        else:
            reproduced = None
    live_param = _live_param(event)
    report: dict[str, Any] = {
        "bundle": path,
        "step": manifest.get("step"),
        "kind": kind,
        "reproduced": reproduced,
        "autocast": manifest.get("autocast"),
        "micro_batches": len(bundle["batch"]),
        "live_param": live_param,
        "same_param": (run["first_nonfinite_param"] == live_param) if live_param else None,
        **run,
    }
    if ablate:
        comps = list(run["losses"])
        rows = []
        for c in comps:
            alone = _run(model, bundle, keep={c}, loss=loss_fn)
            without = _run(model, bundle, keep=set(comps) - {c}, loss=loss_fn)
            rows.append(
                {
                    "component": c,
                    "alone_nonfinite_grad": alone["grad_nonfinite"],
                    "alone_first_param": alone["first_nonfinite_param"],
                    "without_nonfinite_grad": without["grad_nonfinite"],
                }
            )
        report["ablation"] = rows
        report["culprits"] = [r["component"] for r in rows if r["alone_nonfinite_grad"]]
        report["removal_fixes"] = [r["component"] for r in rows if not r["without_nonfinite_grad"]]
    return report


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"bundle   {r['bundle']}",
        f"step     {r['step']}  kind {r['kind']}  micro-batches {r['micro_batches']}  "
        f"autocast {r['autocast'] or 'off'}",
        f"reproduced: {'yes' if r['reproduced'] else ('unknown' if r['reproduced'] is None else 'NO')}",
    ]
    loss_txt = ", ".join(f"{k}={'/'.join(f'{v:.4g}' for v in vs)}" for k, vs in r["losses"].items())
    lines.append(f"losses   {loss_txt}")
    lines.append(f"first non-finite module:    {r['first_nonfinite_module'] or '-'}")
    lines.append(
        f"first non-finite parameter: {r['first_nonfinite_param'] or '-'}"
        + (
            f"  (live event: {r['live_param']}, {'same' if r['same_param'] else 'DIFFERENT'})"
            if r.get("live_param")
            else ""
        )
    )
    if r["overflow_warnings"]:
        lines.append(f"near the dtype limit:       {', '.join(r['overflow_warnings'])}")
    if "ablation" in r:
        lines.append("ablation (loss components one at a time):")
        for row in r["ablation"]:
            alone = "NON-FINITE grad" if row["alone_nonfinite_grad"] else "finite grad"
            without = "NON-FINITE grad" if row["without_nonfinite_grad"] else "finite grad"
            lines.append(f"  {row['component']:<12} alone: {alone:<16} without it: {without}")
        lines.append(f"components producing the non-finite gradient: {', '.join(r['culprits']) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="sfmonitor replay",
        description=__doc__.split("\n\n", 1)[1],  # all of it but the usage line
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("bundle", help="an anomaly bundle folder (run_dir/bundles/<step>-<kind>)")
    p.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="factory that builds the model from the bundle's model_kwargs "
        f"(default: the bundle's, trusted only when an installed package registers "
        f"it under the entry point group {FACTORY_GROUP})",
    )
    p.add_argument("--ablate", action="store_true", help="rerun with each loss component alone / left out")
    p.add_argument(
        "--loss",
        metavar="MODULE:FUNCTION",
        help="function (output, {'args', 'kwargs'}) -> loss, for a model whose forward returns no loss",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    try:
        report = replay_bundle(a.bundle, factory=a.model, ablate=a.ablate, loss=a.loss)
    except BundleError as e:
        print(f"sfmonitor replay: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the model or the loss hook failed on the saved batch: say so, no traceback
        print(f"sfmonitor replay: could not replay {a.bundle}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(jsonable(report), indent=1) if a.json else format_report(report))
    return 0 if report["reproduced"] else 1


if __name__ == "__main__":
    sys.exit(main())
