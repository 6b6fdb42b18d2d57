"""Train Superfusion: ``sfmonitor train --config trap --seed 3 [--monitor] [--run-dir DIR]``.

A flat loop (nanoGPT style): fp16 autocast + GradScaler, gradient accumulation, AdamW or RAdam,
constant or triangular cyclical LR, validation every epoch (Top-1 retrieval, val loss),
checkpoint/resume, DDP under torchrun (gloo on CPU, NCCL on GPU), or FSDP2 with ``--fsdp``
(``fully_shard`` on the vision branch, the text encoder, the fusion module and the root: each
rank holds a shard of every weight). Attaching the monitor is one line; everything else the
monitor does happens through PyTorch hooks.

The last line printed is a JSON result: diverged, first_nan_epoch, final_top1, val_loss,
events {kind: count}, actions {name: count}, seed, config, seconds (and a few extras).
A run "diverged" when its final validation loss is non-finite or its Top-1 is at chance.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from ._schema import Config, ConfigError, option
from .data import BucketedLoader, DataConfig, build_data
from .model import LOSS_NAMES, ModelConfig, build_model

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CHANCE_MARGIN = 0.05  # Top-1 below chance + this counts as "at chance"
RESULT_KEYS = (
    "diverged",
    "first_nan_epoch",
    "final_top1",
    "val_loss",
    "events",
    "actions",
    "seed",
    "config",
    "seconds",
)


@dataclass
class TrainConfig(Config):
    """The optimisation recipe."""

    epochs: int = option(5, "training epochs (report: first NaN in epochs 3-5)", lo=1)
    micro_batch: int = option(8, "images per micro-batch (each with K candidate captions)", lo=1)
    accumulation: int = option(4, "micro-batches per optimizer step (report: 4)", lo=1)
    optimizer: str = option("adamw", "adamw or radam (torch.optim.RAdam)", choices=("adamw", "radam"))
    lr: float = option(3e-4, "learning rate (report's trap: AdamW 3e-4)", lo=0.0, lo_open=True)
    weight_decay: float = option(0.01, "decoupled weight decay", lo=0.0)
    schedule: str = option(
        "constant", "constant or cyclic (triangular CyclicLR from lr/10 to lr)", choices=("constant", "cyclic")
    )
    cycle_steps: int = option(64, "optimizer steps per half cycle of the cyclic schedule", lo=1)
    amp: bool = option(True, "fp16 autocast + GradScaler (the report: fp16 on)")
    init_scale: float = option(65536.0, "GradScaler initial loss scale (report: 65536)", lo=1.0)
    max_grad_norm: float = option(0.0, "clip the total gradient norm (0: off; report's fix: 1.0)", lo=0.0)
    loss_weights: dict[str, float] = option(
        {"vision": 0.4, "text": 0.3, "fusion": 0.3}, "weights of L_v, L_t, L_f (report: 0.4/0.3/0.3)"
    )
    threads: int = option(1, "torch.set_num_threads per process (0: leave as is)", lo=0)
    eval_batch: int = option(8, "images per validation batch", lo=1)

    def validate(self) -> None:
        if set(self.loss_weights) != set(LOSS_NAMES):
            raise ConfigError(
                f"{self._prefix}loss_weights: expected keys {', '.join(LOSS_NAMES)}, "
                f"got {', '.join(sorted(self.loss_weights))}"
            )


@dataclass
class RunConfig(Config):
    """A whole reference run: model, data, train sections (configs/*.yaml)."""

    name: str = option("custom", "name printed in the result line")
    model: ModelConfig = option(ModelConfig, "model shape and stability switches")
    data: DataConfig = option(DataConfig, "data source")
    train: TrainConfig = option(TrainConfig, "optimisation recipe")


def config_path(name: str) -> str:
    """A config name (``trap``), file name (``trap.yaml``) or path -> an existing path."""
    for cand in (name, os.path.join(CONFIG_DIR, name), os.path.join(CONFIG_DIR, name + ".yaml")):
        if os.path.isfile(cand):
            return cand
    known = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    raise ConfigError(f"config {name!r} not found; built-in configs: {', '.join(known)}")


def set_key(data: dict, dotted: str, value: Any) -> None:
    """data["a"]["b"] = value for dotted key "a.b"."""
    *head, last = dotted.split(".")
    for k in head:
        data = data.setdefault(k, {})
        if not isinstance(data, dict):
            raise ConfigError(f"{dotted}: {k} is not a section")
    data[last] = value


def load_config(cfg: RunConfig | dict | str | None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """RunConfig from a RunConfig, dict, config name or YAML path, with dotted-key overrides."""
    import yaml

    if isinstance(cfg, RunConfig):
        data = cfg.to_dict()
    elif isinstance(cfg, dict):
        data = json.loads(json.dumps(cfg))
    elif cfg is None:
        data = {}
    else:
        path = config_path(str(cfg))
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping")
        data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    for k, v in (overrides or {}).items():
        set_key(data, k, v)
    return RunConfig.from_dict(data)


# --------------------------------------------------------------------------------------------
# Pieces of the loop
# --------------------------------------------------------------------------------------------


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if tc.optimizer == "adamw" else torch.optim.RAdam
    kwargs: dict[str, Any] = {"decoupled_weight_decay": True} if tc.optimizer == "radam" else {}
    return cls(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, **kwargs)


def make_scheduler(opt: torch.optim.Optimizer, tc: TrainConfig):
    if tc.schedule == "constant":
        return None
    return torch.optim.lr_scheduler.CyclicLR(
        opt, base_lr=tc.lr / 10, max_lr=tc.lr, step_size_up=tc.cycle_steps, mode="triangular", cycle_momentum=False
    )


def autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.float16, enabled=enabled)


@torch.no_grad()
def evaluate(model, data, tc: TrainConfig, device: torch.device) -> dict[str, float]:
    """Top-1 retrieval accuracy (non-finite scores count as wrong), weighted val loss, max |logit|."""
    was = model.training
    model.eval()
    correct, total, loss_sum, max_logit = 0, 0, torch.zeros(()), torch.zeros(())
    for batch in BucketedLoader(data, tc.eval_batch, seed=0, shuffle=False):
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(device, tc.amp):
            scores, losses = model.scores_and_losses(**batch)
        ok = torch.isfinite(scores).all(1) & (scores.argmax(1) == batch["target"])
        correct += int(ok.sum())
        n = batch["target"].shape[0]
        total += n
        loss_sum += sum(tc.loss_weights[k] * losses[k].float() for k in LOSS_NAMES).cpu() * n
        max_logit = torch.maximum(max_logit, model.fusion.last_max_logit.float().cpu())
    model.train(was)
    return {"top1": correct / max(total, 1), "loss": float(loss_sum) / max(total, 1), "max_logit": float(max_logit)}


# FSDP2 units, innermost first. The text branch's embeddings and head stay with the root: the
# root's scores_and_losses calls text.head directly, outside the text branch's own forward.
UNITS = ("vision", "text.encoder", "fusion", "")


def shard(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """FSDP2: ``fully_shard`` the ``UNITS`` (the vision branch, the text encoder, the fusion
    module, then the root); the evaluation entry point ``scores_and_losses`` gathers the
    parameters like ``forward`` does.

    ``fully_shard`` refuses 0-d parameters (the learnable temperature ``fusion.log_tau``): they are
    left out of the sharding, replicated on every rank, and returned; ``sync_replicated`` averages
    their gradients across ranks before each update, as DDP would."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    scalars = [p for p in model.parameters() if p.dim() == 0]
    if scalars and "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise ConfigError(
            "--fsdp: the model has 0-d parameters (model.learn_temperature), which fully_shard can only "
            f"leave out with ignored_params (torch >= 2.7; installed: {torch.__version__}); "
            "set model.learn_temperature=false or upgrade torch"
        )
    for name in UNITS:
        module = model.get_submodule(name)
        mine = {p for p in module.parameters() if p.dim() == 0}
        fully_shard(module, ignored_params=mine) if mine else fully_shard(module)
    register_fsdp_forward_method(model, "scores_and_losses")
    return scalars


def sync_replicated(params: list[torch.nn.Parameter]) -> None:
    """Average the gradients of the parameters FSDP2 left replicated (see ``shard``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        flat = torch.stack([g.reshape(()) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= torch.distributed.get_world_size()
        for g, v in zip(grads, flat):
            g.copy_(v)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """FSDP2: the full (unsharded) model and optimizer state dicts on the host, keyed by parameter
    name. A collective: every rank calls it; rank 0 writes them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, model_sd: dict, opt_sd: dict) -> None:
    """FSDP2: load what ``full_state`` saved into this rank's shards (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd, options=StateDictOptions(full_state_dict=True)
    )


def save_checkpoint(path: str, state: dict) -> None:
    """Atomic: write a temporary file, then rename over the old one."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _json_safe(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _progress(total: int, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the `reference` extra; without it, plain lines
        return _PlainProgress(total)
    return tqdm(total=total, unit="mb", dynamic_ncols=True, leave=False)


class _PlainProgress:
    """The progress bar's interface without tqdm: one line to stderr every ~5 s and at the end."""

    def __init__(self, total: int) -> None:
        self.total, self.n, self.desc, self.postfix = total, 0, "", ""
        self._last = time.monotonic()

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def set_postfix(self, refresh: bool = False, **kwargs: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in kwargs.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last >= 5.0 or self.n >= self.total:
            self._last = time.monotonic()
            print(f"{self.desc} {self.n}/{self.total} {self.postfix}".strip(), file=sys.stderr)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a run trains on; a clear ConfigError for one that cannot be used here."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device: {e}") from None
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: torch {torch.__version__} sees no CUDA device here")
    if out.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: the trainer runs on cpu or cuda")
    return out


def train(
    cfg: RunConfig | dict | str,
    seed: int = 0,
    monitor: bool = False,
    run_dir: str | None = None,
    monitor_config: Any = None,
    *,
    progress: bool | None = False,
    resume: str | None = None,
    sinks: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    verbose: bool = False,
    fsdp: bool = False,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Train one run and return its result dict (the JSON line main() prints). ``device``: where
    to train ("cpu", "cuda", ...); None: this rank's GPU (``LOCAL_RANK``) when CUDA is available,
    else the CPU."""
    t0 = time.perf_counter()
    run_device = resolve_device(device)
    cfg = load_config(cfg, overrides)
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = run_device
    if (world > 1 or fsdp) and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")

    train_set, val_set, vocab, n_classes = build_data(cfg.data, cfg.model.max_len)
    mcfg = dataclasses.replace(cfg.model, vocab_size=vocab, num_classes=n_classes)
    torch.manual_seed(seed)
    model = build_model(mcfg).to(device)
    replicated: list[torch.nn.Parameter] = []  # FSDP2: parameters left out of the sharding
    if fsdp:
        replicated = shard(model)  # before the optimizer: it must hold the sharded parameters
    opt = make_optimizer(model, tc)
    sched = make_scheduler(opt, tc)
    if fsdp:  # a shard's overflow must skip the step on every rank: found-inf is all-reduced
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler: torch.amp.GradScaler = ShardedGradScaler(device.type, init_scale=tc.init_scale, enabled=tc.amp)
    else:
        scaler = torch.amp.GradScaler(device.type, init_scale=tc.init_scale, enabled=tc.amp)
    net: torch.nn.Module = model
    ddp: torch.nn.parallel.DistributedDataParallel | None = None  # set when world > 1 without FSDP
    if world > 1 and not fsdp:
        net = ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    loader = BucketedLoader(train_set, tc.micro_batch, seed=seed, rank=rank, world=world)
    K = train_set.num_candidates
    chance = 1.0 / K

    start_epoch, hist = 0, []
    counters: Counter[str] = Counter()
    monitor_state = None
    first_nan_epoch = None
    if resume:
        ck = torch.load(resume, map_location="cpu" if fsdp else device, weights_only=True)
        if fsdp:
            load_full_state(model, opt, ck["model"], ck["optimizer"])
        else:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        if sched is not None and ck.get("scheduler"):
            sched.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["rng"])
        start_epoch, hist = int(ck["epoch"]), list(ck["history"])
        counters.update(ck["counters"])
        first_nan_epoch = ck["first_nan_epoch"] if ck["first_nan_epoch"] >= 0 else None
        monitor_state = ck.get("monitor") or None
    if run_dir and rank == 0:
        os.makedirs(run_dir, exist_ok=True)

    mon = None
    if monitor:
        import sfmonitor  # lazy: the bare trainer needs nothing of the plugin

        mcfg_monitor = copy.deepcopy(  # (the caller's own config object stays as given)
            sfmonitor.MonitorConfig.from_any(monitor_config if monitor_config is not None else config_path("monitor"))
        )
        collapse = mcfg_monitor.detectors.accuracy_collapse
        if collapse.samples is None:  # Top-1 is measured on the whole validation set
            collapse.samples = len(val_set)
        mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=run_dir, sinks=sinks, config=mcfg_monitor)
        # `sfmonitor replay BUNDLE` rebuilds this model from its anomaly bundles.
        mon.set_model_factory("reference_model.model:build_model", cfg=mcfg.to_dict())
        if monitor_state is not None:  # resume: windows, rescued LR scale and weights, budget
            mon.load_state_dict(monitor_state)

    weights = dict(tc.loss_weights)
    bar = _progress((tc.epochs - start_epoch) * len(loader), progress)
    last_event = "-"
    stopped = None
    ev = {}
    try:
        for epoch in range(start_epoch, tc.epochs):
            loader.set_epoch(epoch)
            n_micro = len(loader)
            batches = mon.batches(loader) if mon is not None else loader
            for i, batch in enumerate(batches):
                batch = {k: v.to(device) for k, v in batch.items()}
                boundary = (i + 1) % tc.accumulation == 0 or i + 1 == n_micro
                sync = ddp.no_sync() if (ddp is not None and not boundary) else contextlib.nullcontext()
                if fsdp:  # accumulate unsharded gradients; reduce-scatter on the last micro-batch
                    model.set_requires_gradient_sync(boundary)  # type: ignore[operator]
                with sync:
                    with autocast(device, tc.amp):
                        losses = net(**batch)
                    if mon is not None:
                        loss = mon.combine(losses, weights=weights)
                    else:
                        loss = sum(weights[k] * losses[k] for k in LOSS_NAMES)
                    scaler.scale(loss / tc.accumulation).backward()
                loss_value = float(loss.detach())
                if not math.isfinite(loss_value):
                    counters["nonfinite_microbatches"] += 1
                    if first_nan_epoch is None:
                        first_nan_epoch = epoch + 1
                if boundary:
                    if replicated:
                        sync_replicated(replicated)
                    if tc.max_grad_norm > 0:
                        scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm)
                    before = scaler.get_scale() if tc.amp else 1.0
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
                    if tc.amp and scaler.get_scale() < before:
                        counters["skipped_steps"] += 1
                    if sched is not None:
                        sched.step()
                    counters["optimizer_steps"] += 1
                if bar is not None:
                    if mon is not None and mon.events:
                        last_event = mon.events[-1].kind
                    gn = mon.stats.get("grad_norm/total", float("nan")) if mon is not None else float("nan")
                    bar.set_description(f"epoch {epoch + 1}/{tc.epochs}")
                    bar.set_postfix(loss=f"{loss_value:.3f}", gnorm=f"{gn:.3g}", event=last_event, refresh=False)
                    bar.update(1)
            ev = evaluate(model, val_set, tc, device)
            hist.append(
                {
                    "epoch": epoch + 1,
                    "top1": ev["top1"],
                    "val_loss": ev["loss"],
                    "max_logit": ev["max_logit"],
                    "loss_scale": scaler.get_scale() if tc.amp else 1.0,
                }
            )
            if verbose and rank == 0:
                print(json.dumps(_json_safe(hist[-1])), file=sys.stderr, flush=True)
            model_sd, opt_sd = full_state(model, opt) if fsdp and run_dir else (None, None)
            if run_dir and rank == 0:
                save_checkpoint(
                    os.path.join(run_dir, "checkpoint.pt"),
                    {
                        "model": model_sd if fsdp else model.state_dict(),
                        "optimizer": opt_sd if fsdp else opt.state_dict(),
                        "scaler": scaler.state_dict(),
                        "scheduler": sched.state_dict() if sched is not None else {},
                        "rng": torch.get_rng_state(),
                        "epoch": epoch + 1,
                        "history": hist,
                        "counters": dict(counters),
                        "monitor": mon.state_dict() if mon is not None else {},
                        "first_nan_epoch": first_nan_epoch if first_nan_epoch is not None else -1,
                    },
                )
            if mon is not None:
                mon.observe_eval({"accuracy": ev["top1"], "loss": ev["loss"]}, chance=chance)
                if mon.should_stop:
                    stopped = "monitor.should_stop"
                    break
    except Exception as e:  # the monitor's stop action ends the run; anything else propagates
        if type(e).__name__ != "StopTraining":
            raise
        stopped = str(e)
    finally:
        if bar is not None:
            bar.close()
        if mon is not None:
            mon.detach()

    if not ev:
        ev = evaluate(model, val_set, tc, device)
    events = Counter(e.kind for e in mon.events) if mon is not None else Counter()
    actions = Counter(a for e in mon.events for a in e.actions) if mon is not None else Counter()
    diverged = not _finite(ev["loss"]) or ev["top1"] < chance + CHANCE_MARGIN
    result = {
        "diverged": diverged,
        "first_nan_epoch": first_nan_epoch,
        "final_top1": round(ev["top1"], 4),
        "val_loss": round(ev["loss"], 4) if _finite(ev["loss"]) else ev["loss"],
        "events": dict(events),
        "actions": dict(actions),
        "seed": seed,
        "config": cfg.name,
        "seconds": round(time.perf_counter() - t0, 1),
        "monitor": bool(monitor),
        "nonfinite_microbatches": counters["nonfinite_microbatches"],
        "skipped_steps": counters["skipped_steps"],
        "optimizer_steps": counters["optimizer_steps"],
        "loss_scale": scaler.get_scale() if tc.amp else 1.0,
        "max_logit": ev["max_logit"],
        "stopped": stopped,
        "history": hist,
        "world_size": world,
        "fsdp": fsdp,
        "run_dir": mon.run_dir if mon is not None else run_dir,  # the monitor picks one if not given
    }
    return _json_safe(result)


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` arguments as overrides (values parsed as YAML: 12, true, [a, b])."""
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def main(argv: list[str] | None = None) -> int:
    """train the Superfusion reference model (see --help)"""
    p = argparse.ArgumentParser(prog="sfmonitor train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="trap", help="config name in reference_model/configs or a YAML path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--monitor", dest="monitor", action="store_true", help="attach sfmonitor")
    p.add_argument("--no-monitor", dest="monitor", action="store_false", help="train bare (default)")
    p.set_defaults(monitor=False)
    p.add_argument(
        "--sinks",
        default=None,
        type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
        help="where the monitor writes: comma-separated jsonl,console,tensorboard,wandb "
        "(default: jsonl and one console line per event)",
    )
    p.add_argument(
        "--monitor-config", default=None, help="sfmonitor YAML config (default: reference_model/configs/monitor.yaml)"
    )
    p.add_argument("--run-dir", default=None, help="folder for the checkpoint and the monitor's logs")
    p.add_argument("--epochs", type=int, default=None, help="override train.epochs")
    p.add_argument("--resume", default=None, help="checkpoint.pt to resume from")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set model.qk_init_gain=12 (repeatable)",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="no progress bar (it is off anyway when stderr is not a terminal)",
    )
    p.add_argument("--verbose", action="store_true", help="print one JSON line per epoch to stderr")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: this rank's GPU if any, else cpu)")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 (fully_shard) instead of DDP; run it under torchrun, e.g. "
        "torchrun --nproc_per_node=2 -m reference_model.train --fsdp (a checkpoint resumes with --fsdp)",
    )
    args = p.parse_args(argv)
    try:
        overrides = parse_sets(args.set)
    except ValueError as e:
        p.error(str(e))
    if args.epochs is not None:
        overrides["train.epochs"] = args.epochs
    config_errors: tuple[type[Exception], ...] = (ConfigError,)
    if args.monitor:  # a bad monitor config is reported like a bad run config
        from sfmonitor import ConfigError as MonitorConfigError

        config_errors += (MonitorConfigError,)
    try:
        result = train(
            args.config,
            seed=args.seed,
            monitor=args.monitor,
            run_dir=args.run_dir,
            monitor_config=args.monitor_config,
            progress=args.progress,
            resume=args.resume,
            overrides=overrides,
            verbose=args.verbose,
            fsdp=args.fsdp,
            sinks=args.sinks,
            device=args.device,
        )
    except config_errors as e:
        print(f"sfmonitor train: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        out = {k: v for k, v in result.items() if k != "history"}
        print(json.dumps(out), flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _leave_process_group()
    return 0


def _leave_process_group() -> NoReturn:
    """End a distributed run's process: a barrier, the group destroyed, the output flushed, and
    exit status 0 without the interpreter's teardown."""
    # The barrier first: destroying a gloo group while its threads still free a finished
    # collective's tensors (which needs the GIL this thread holds) can deadlock inside torch.
    # Then no teardown: gloo threads joined while the interpreter finalises abort a rank now and
    # then, after its work is done ("terminate called without an active exception", SIGABRT: once
    # in CI on the DDP run; pytorch/pytorch#179291 describes the mechanism). Every file this run
    # writes is closed by now (the monitor's sinks at detach, the checkpoint by torch.save).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
