"""Faults and healthy runs: how close does a monitored run end to its fault-free twin?

    python benchmarks/faults.py --quick                      # a subset, under a minute
    python benchmarks/faults.py                              # every model x scenario, ~5 min a seed
    python benchmarks/faults.py --models gpt,cnn --scenarios nan_batch,lr_spike --steps 80 --json out.json
    python benchmarks/faults.py --show out.json              # the tables again, from the JSON
    python benchmarks/faults.py --device cuda --scenarios fault_free,nan_batch,lr_spike --no-isolate

Models (benchmarks/fault_models.py): a nanoGPT-style char-level GPT (``gpt``), a transformers
``BertForMaskedLM`` from a tiny ``BertConfig`` (``bert``), a small CNN with BatchNorm on synthetic
images (``cnn``), and the reference model through its own trainer, ``reference_model.train.train``
with the ``tiny`` config (``reference``: fp16 autocast + GradScaler, gradient accumulation 2).

Scenarios (``f`` = the fault step, 40% into the run, after the detectors' warm-up):

* ``fault_free``: the monitored run against the bare one (the twin): 0 actions, bit-identical;
* ``nan_batch``: the batch of step f holds a NaN;
* ``lr_spike``: step f runs at 10^4 x the LR (one bad update lands);
* ``loss_spike``: the loss of step f is multiplied by 10^4;
* ``bad_labels``: a stretch of steps (f to f + steps/10) with random labels;
* ``bad_every``: a batch of noise with random labels every N steps over a longer run;
* ``eval_combine``: healthy, with an evaluation every few steps through ``monitor.combine()``
  under ``torch.no_grad()``, against the bare run with the same evaluations;
* ``lightning``: healthy, through ``SFMonitorCallback`` in a CPU Lightning Trainer with a
  validation loop (``combine`` in training_step and validation_step), against bare Lightning;
* ``hf_trainer``: healthy, BERT through the HF Trainer with evaluation and
  ``SFMonitorTrainerCallback`` (``compute_loss`` overridden with ``combine`` as
  docs/integrations.md shows), against the bare Trainer;
* ``high_lr``: the GPT at 20x its LR without warm-up, bare and monitored, against its default LR;
* ``scaled_batch``: the CNN's images of one step (f) at 1e3x their scale (a pipeline that skipped
  its normalisation once): an ordinary loss, and a variance that lands in BatchNorm's statistics.

Every fault scenario also runs the bare run with the fault and the exact twin: the bare run that
never runs the faulty steps (it keeps the loop's schedule). Where the rescue is a skip or an undo
(nan_batch, lr_spike, loss_spike, scaled_batch) the monitored run should equal it bit for bit.

Each arm runs in a forked child process (peak RSS is that run's own); the twins share the seed,
the data and its order. From each monitored run's events.jsonl: actions, event kinds, steps thrown
away (updates undone by rollback/undo: ``steps_back``; skipped updates; batches ``batches()`` left
out; minus batches it yielded again). Prints one markdown row per model x scenario. Latest results
and how to read them: docs/benchmarks.md. Not part of the test suite (a smoke run is).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _checkout  # noqa: E402 - this checkout's sfmonitor, not an editable install's

ROOT = _checkout.ROOT

from fault_models import TASKS, Task  # noqa: E402 - after the path

MODELS = ("gpt", "bert", "cnn", "reference")
SCENARIOS = (
    "fault_free",
    "nan_batch",
    "lr_spike",
    "loss_spike",
    "bad_labels",
    "bad_every",
    "eval_combine",
    "lightning",
    "hf_trainer",
    "high_lr",
    "scaled_batch",
)
# Which scenarios each model runs (the reference trainer evaluates every epoch on its own).
APPLIES = {
    "gpt": set(SCENARIOS) - {"hf_trainer", "scaled_batch"},
    "bert": set(SCENARIOS) - {"lightning", "high_lr", "scaled_batch"},
    "cnn": set(SCENARIOS) - {"hf_trainer", "high_lr"},  # (scaled_batch: images through BatchNorm)
    "reference": {"fault_free", "nan_batch", "lr_spike", "loss_spike", "bad_labels", "bad_every"},
}
QUICK = {"models": "gpt,cnn", "scenarios": "fault_free,nan_batch,lr_spike,eval_combine", "steps": 60}
LR_FAULT = 1e4  # the LR of the faulty step, x the run's own
LOSS_FAULT = 1e4  # the loss of the faulty batch, x its own
TRAIN_TAIL = 10  # final train loss: the mean over this many last healthy steps
# a skip or an exact undo: equal to the twin without the step
EXACT = ("nan_batch", "lr_spike", "loss_spike", "scaled_batch")
TOLERANCE = 1.05  # the target: final loss <= 1.05 x the fault-free twin
SPIKE = 1.10  # an early spike: loss above 1.10 x the lowest loss so far


@dataclass(frozen=True)
class Arm:
    """One run. Twins differ only in what is listed here."""

    steps: int
    monitored: bool = False
    faults: tuple[tuple[str, int], ...] = ()  # (kind, step): nan, lr, loss, garbage, labels
    drop: tuple[int, ...] = ()  # steps the twin leaves out (it never sees those batches)
    eval_every: int = 0  # an evaluation pass every this many steps (through combine when monitored)
    lr_mult: float = 1.0
    driver: str = "loop"  # loop, lightning, hf, reference


@dataclass
class Options:
    steps: int = 100
    long_steps: int = 300
    every: int = 20
    eval_every: int = 20
    high_lr_mult: float = 20.0
    high_lr_steps: int = 150
    seed: int = 0
    monitor_config: dict[str, Any] = field(default_factory=dict)
    isolate: bool = True  # one forked process per run (per-run peak RSS)
    root: str = ""  # run folders go here
    device: str = "cpu"  # the loop and reference runs' device (Lightning and HF stay on the CPU)

    def fault_step(self, steps: int) -> int:
        return max(1, int(0.4 * steps))


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


def monitor_config(opts: Options) -> dict[str, Any]:
    return {"console": False, **opts.monitor_config}


def weights_digest(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of the parameters and of the buffers (BatchNorm running statistics...), each in
    state_dict order: equal digests, equal bits."""
    params = {id(p) for p in model.parameters()}
    out = {}
    for part in ("params", "buffers"):
        h = hashlib.sha256()
        for k, v in model.state_dict(keep_vars=True).items():
            if (id(v) in params) == (part == "params"):
                h.update(k.encode())
                h.update(v.detach().cpu().contiguous().numpy().tobytes())
        out[part] = h.hexdigest()
    return out


def all_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in model.state_dict().values() if v.is_floating_point())


def to_device(batch: dict, device: str) -> dict:
    """The batch's tensors on ``device`` (batches are made, and spoiled, on the CPU)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def sync(device: str) -> None:
    """Wait for the device's queued work, so a step's time is its whole time."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def eval_loss(task: Task, model: torch.nn.Module, device: str = "cpu") -> float:
    was = model.training
    model.eval()
    value = statistics.fmean(float(task.loss(model, to_device(b, device))) for b in task.eval_batches())
    model.train(was)
    return value


def faults_at(arm: Arm) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for kind, step in arm.faults:
        out.setdefault(step, set()).add(kind)
    return out


def spoil(task: Task, batch: dict, kinds: set[str], g: torch.Generator) -> dict:
    if "garbage" in kinds:
        batch = task.garbage(batch, g)
    if "labels" in kinds:
        batch = task.scramble(batch, g)
    if "nan" in kinds:
        batch = task.poison(batch)
    if "scale" in kinds:
        batch = task.rescale(batch)
    return batch


def step_seed(seed: int, i: int) -> int:
    """The RNG seed of step i (dropout): the same whatever steps came before (skips, repeats)."""
    return seed * 1_000_003 + i


def run_loop(task: Task, arm: Arm, seed: int, run_dir: str, opts: Options) -> dict[str, Any]:
    """A plain training loop (the README's): batches through monitor.batches(), one loss through
    monitor.combine(), clipping (if the task clips) before optimizer.step()."""
    torch.manual_seed(seed)
    model, opt = task.build()
    model.to(opts.device)  # the parameters stay the objects the optimizer holds
    data = task.train_batches(arm.steps, seed)
    faults = faults_at(arm)
    mon = None
    if arm.monitored:
        import sfmonitor

        mon = sfmonitor.attach(model, opt, run_dir=run_dir, sinks=["jsonl"], config=monitor_config(opts))
    drawn: Counter[int] = Counter()
    losses: list[tuple[int, float, bool]] = []  # (step, loss of the batch as drawn, faulty)
    times: list[float] = []
    stopped = None
    source = mon.batches(range(len(data))) if mon is not None else range(len(data))
    lr = task.lr * arm.lr_mult
    try:
        for i in source:
            drawn[i] += 1
            if i in arm.drop:
                continue
            kinds = faults.get(i, set())
            torch.manual_seed(step_seed(seed, i))
            batch = spoil(task, data[i], kinds, torch.Generator().manual_seed(step_seed(seed, i)))
            batch = to_device(batch, opts.device)
            sync(opts.device)
            t0 = time.perf_counter()
            for pg in opt.param_groups:  # nanoGPT sets the LR itself every iteration
                pg["lr"] = lr * (LR_FAULT if "lr" in kinds else 1.0)
            loss = task.loss(model, batch)
            losses.append((i, float(loss.detach()), bool(kinds)))
            if "loss" in kinds:
                loss = loss * LOSS_FAULT
            if mon is not None:
                loss = mon.combine(loss)
            loss.backward()
            if task.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(opts.device)
            times.append(time.perf_counter() - t0)
            if arm.eval_every and (i + 1) % arm.eval_every == 0:
                model.eval()
                with torch.no_grad():  # a validation pass, as users write it
                    for b in task.eval_batches()[:2]:
                        value = task.loss(model, to_device(b, opts.device))
                        if mon is not None:
                            mon.combine(value)
                model.train()
    except Exception as e:  # StopTraining through a plain loop
        if type(e).__name__ != "StopTraining":
            raise
        stopped = str(e)
    finally:
        if mon is not None:
            stopped = stopped or ("should_stop" if mon.should_stop else None)
            mon.detach()
    last = max(drawn) if drawn else -1
    return {
        "losses": losses,
        "eval_loss": eval_loss(task, model, opts.device),
        "digest": weights_digest(model),
        "finite": all_finite(model),
        "step_ms": 1e3 * statistics.median(times) if times else None,
        "stopped": stopped,
        "left_out": sum(1 for i in range(last + 1) if i not in drawn) if mon is not None else 0,
        "repeated": sum(n - 1 for n in drawn.values()),
    }


def run_lightning(task: Task, arm: Arm, seed: int, run_dir: str, opts: Options) -> dict[str, Any]:
    """The task as a LightningModule (CPU, fp32), validation every ``eval_every`` steps."""
    import logging
    import warnings

    import lightning.pytorch as pl

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    cb = None
    if arm.monitored:
        from sfmonitor.integrations.lightning import SFMonitorCallback

        cb = SFMonitorCallback(run_dir=run_dir, sinks=["jsonl"], config=monitor_config(opts))
    torch.manual_seed(seed)
    net, opt = task.build()
    losses: list[tuple[int, float, bool]] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            torch.manual_seed(step_seed(seed, batch_idx))
            loss = task.loss(self.net, batch)
            losses.append((batch_idx, float(loss.detach()), False))
            return cb.monitor.combine(loss) if cb is not None else loss

        def validation_step(self, batch, batch_idx):
            loss = task.loss(self.net, batch)
            if cb is not None:
                loss = cb.monitor.combine(loss)
            self.log("val_loss", loss, batch_size=task.batch)

        def configure_optimizers(self):
            return opt

    loader = torch.utils.data.DataLoader(task.train_batches(arm.steps, seed), batch_size=None)
    val = torch.utils.data.DataLoader(task.eval_batches()[:2], batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        max_steps=arm.steps,
        val_check_interval=arm.eval_every or None,
        gradient_clip_val=task.clip or None,
        callbacks=[cb] if cb is not None else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    trainer.fit(Module(), loader, val)
    seconds = time.perf_counter() - t0
    stopped = (cb.stop_reason or ("should_stop" if cb.monitor.should_stop else None)) if cb is not None else None
    return {
        "losses": losses,
        "eval_loss": eval_loss(task, net),
        "digest": weights_digest(net),
        "finite": all_finite(net),
        "step_ms": 1e3 * seconds / max(1, len(losses)),
        "stopped": stopped,
        "left_out": 0,
        "repeated": 0,
    }


def run_hf(task: Task, arm: Arm, seed: int, run_dir: str, opts: Options) -> dict[str, Any]:
    """BERT through the HF Trainer with evaluation; ``compute_loss`` passes the loss through
    ``combine`` as docs/integrations.md shows (the Trainer also calls it for evaluation)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cb = None
    if arm.monitored:
        from sfmonitor.integrations.transformers import SFMonitorTrainerCallback

        cb = SFMonitorTrainerCallback(run_dir=run_dir, sinks=["jsonl"], config=monitor_config(opts))
    torch.manual_seed(seed)
    model, _ = task.build()  # the Trainer makes its own AdamW
    keys = ("input_ids", "attention_mask", "labels")

    class Examples(torch.utils.data.Dataset):
        def __init__(self, batches):
            self.rows = [{k: b[k][j] for k in keys} for b in batches for j in range(len(b["labels"]))]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    losses: list[tuple[int, float, bool]] = []

    class Trainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kw)
            if model.training:
                losses.append((len(losses), float(loss.detach()), False))
            if cb is not None:
                loss = cb.monitor.combine(loss)
            return (loss, outputs) if return_outputs else loss

    args = transformers.TrainingArguments(
        output_dir=os.path.join(run_dir, "hf"),
        per_device_train_batch_size=task.batch,
        per_device_eval_batch_size=task.batch,
        max_steps=arm.steps,
        learning_rate=task.lr,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
        eval_strategy="steps" if arm.eval_every else "no",
        eval_steps=arm.eval_every or None,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Examples(task.train_batches(arm.steps, seed)),
        eval_dataset=Examples(task.eval_batches()[:2]),
        callbacks=[cb] if cb is not None else [],
    )
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        if cb is not None:
            cb.monitor.detach()
    seconds = time.perf_counter() - t0
    stopped = (cb.stop_reason or ("should_stop" if cb.monitor.should_stop else None)) if cb is not None else None
    return {
        "losses": losses,
        "eval_loss": eval_loss(task, model),
        "digest": weights_digest(model),
        "finite": all_finite(model),
        "step_ms": 1e3 * seconds / max(1, len(losses)),
        "stopped": stopped,
        "left_out": 0,
        "repeated": 0,
    }


def run_reference(arm: Arm, seed: int, run_dir: str, opts: Options) -> dict[str, Any]:
    """The reference model through ``reference_model.train.train`` (``tiny`` config, 4 optimizer
    steps an epoch, 2 micro-batches a step, fp16 autocast + GradScaler). Faults enter through hooks
    the benchmark puts on the model and the optimizer as the trainer builds them: a NaN image, noise
    images with random labels, random labels, the losses x 10^4 (forward hooks on the micro-batches
    of the step), the LR x 10^4 (optimizer pre/post hooks). The twin that leaves a step out hides
    its gradients from the optimizer (as a skip does)."""
    import reference_model.train as rt
    from reference_model.model import LOSS_NAMES

    cfg = rt.load_config("tiny")
    accum = cfg.train.accumulation
    per_epoch = math.ceil(cfg.data.n_train / cfg.train.micro_batch / accum)
    epochs = max(1, math.ceil(arm.steps / per_epoch))
    weights = dict(cfg.train.loss_weights)
    faults = faults_at(arm)
    state: dict[str, Any] = {"fwd": 0, "model": None, "lr_hit": False, "last": None}
    micro: dict[int, list[float]] = {}
    times: list[float] = []

    def step_now() -> int:
        return state["fwd"] // accum

    def pre(module, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        kinds = faults.get(step_now(), set())
        if not kinds:
            return None
        g = torch.Generator().manual_seed(step_seed(seed, state["fwd"]))
        kw = dict(kwargs)
        dev = kw["images"].device  # drawn on the CPU (the same draws on every device), then moved
        if "garbage" in kinds:
            kw["images"] = (3.0 * torch.randn(kw["images"].shape, generator=g)).to(dev)
        if kinds & {"garbage", "labels"}:
            kw["target"] = torch.randint(0, kw["captions"].shape[1], kw["target"].shape, generator=g).to(dev)
            kw["category"] = torch.randint(0, cfg.model.num_classes, kw["category"].shape, generator=g).to(dev)
        if "nan" in kinds and state["fwd"] % accum == 0:
            kw["images"] = kw["images"].clone()
            kw["images"][0, 0, 0, 0] = float("nan")
        return args, kw

    def post(module, args, kwargs, out):
        if not torch.is_grad_enabled():
            return None
        s = step_now()
        state["fwd"] += 1
        micro.setdefault(s, []).append(float(sum(weights[k] * out[k].detach().float() for k in LOSS_NAMES)))
        if "loss" in faults.get(s, set()):
            return {k: v * LOSS_FAULT for k, v in out.items()}
        return None

    def opt_pre(optimizer, a, kw):
        s = state["fwd"] // accum - 1  # the step whose micro-batches just ran
        sync(opts.device)
        now = time.perf_counter()
        if state["last"] is not None:
            times.append(now - state["last"])
        state["last"] = now
        if s in arm.drop:
            for pg in optimizer.param_groups:
                for p in pg["params"]:
                    p.grad = None
        if "lr" in faults.get(s, set()):
            state["lr_hit"] = True
            for pg in optimizer.param_groups:
                pg["lr"] = pg["lr"] * LR_FAULT

    def opt_post(optimizer, a, kw):
        if state["lr_hit"]:
            state["lr_hit"] = False
            for pg in optimizer.param_groups:
                pg["lr"] = pg["lr"] / LR_FAULT

    build_model, make_optimizer = rt.build_model, rt.make_optimizer

    def build(mcfg):
        model = build_model(mcfg)
        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True)
        state["model"] = model
        return model

    def make_opt(model, tc):
        opt = make_optimizer(model, tc)
        opt.register_step_pre_hook(opt_pre)  # before the monitor's hooks: the monitor attaches later
        opt.register_step_post_hook(opt_post)
        return opt

    rt.build_model, rt.make_optimizer = build, make_opt
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = rt.train(
                "tiny",
                seed=seed,
                monitor=arm.monitored,
                run_dir=run_dir,
                monitor_config=monitor_config(opts) if arm.monitored else None,
                overrides={"train.epochs": epochs},
                device=opts.device,
            )
    finally:
        rt.build_model, rt.make_optimizer = build_model, make_optimizer
    model = state["model"]
    losses = [(s, statistics.fmean(v), bool(faults.get(s))) for s, v in sorted(micro.items())]
    return {
        "losses": losses,
        "eval_loss": float(result["val_loss"]),  # a non-finite loss comes back as "nan"/"inf"
        "digest": weights_digest(model),
        "finite": all_finite(model),
        "step_ms": 1e3 * statistics.median(times) if times else None,
        "stopped": result.get("stopped"),
        "left_out": 0,
        "repeated": 0,
        "optimizer_steps": result.get("optimizer_steps"),
        "micro_per_step": accum,
    }


def read_events(run_dir: str) -> list[dict[str, Any]]:
    from sfmonitor.sinks.jsonl import read_jsonl

    return read_jsonl(os.path.join(run_dir, "events.jsonl"))


def thrown_away(events: list[dict[str, Any]], left_out: float, repeated: float) -> dict[str, float]:
    """Steps thrown away, from the events: updates undone (``steps_back`` of a rollback or an undo
    that restored), updates skipped (each step once), batches ``batches()`` left out, less the
    batches it yielded again (an undo re-uses the batch of the step that found the trouble)."""
    undone, skipped = 0, set()
    for e in events:
        results = (e.get("data") or {}).get("action_results") or {}
        for facts in results.values():
            if not isinstance(facts, dict):
                continue
            if facts.get("restored") and isinstance(facts.get("steps_back"), int):
                undone += facts["steps_back"]
            if isinstance(facts.get("skipped_step"), int):
                skipped.add(facts["skipped_step"])
    lost = undone + len(skipped) + left_out - repeated
    return {"lost": lost, "undone": undone, "skipped": len(skipped), "left_out": left_out, "repeated": repeated}


def acted(event: dict[str, Any]) -> list[str]:
    """The actions of an event that changed training (a decided clip that found nothing to clip,
    a fallback for a module already in fp32, are not counted: the budget does not count them either)."""
    from sfmonitor.events import Event

    return Event.from_dict({"step": 0, "kind": "", **event}).changed()


def run_arm(model_name: str, arm: Arm, opts: Options) -> dict[str, Any]:
    """One run, in this process. Returns its measurements (and the monitor's, when monitored)."""
    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix=f"{model_name}-", dir=opts.root or None)
    t0 = time.perf_counter()
    if arm.driver == "reference":
        out = run_reference(arm, opts.seed, run_dir, opts)
    else:
        task = TASKS[model_name]()
        fn: Callable[..., dict[str, Any]] = {"loop": run_loop, "lightning": run_lightning, "hf": run_hf}[arm.driver]
        out = fn(task, arm, opts.seed, run_dir, opts)
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["final_train"] = final_train(out["losses"])
    if arm.monitored:
        events = read_events(run_dir)
        out["events"] = events
        out["kinds"] = dict(Counter(e["kind"] for e in events))
        out["actions"] = dict(Counter(a for e in events for a in acted(e)))
        if out.get("micro_per_step"):
            # The reference trainer draws micro-batches through batches(): a rollback leaves out
            # `batches_to_skip` of them, an undo yields every micro-batch of its step again (one
            # step); in optimizer steps here.
            done = [
                (a, facts)
                for e in events
                for a, facts in ((e.get("data") or {}).get("action_results") or {}).items()
                if isinstance(facts, dict) and facts.get("restored")
            ]
            micro = out["micro_per_step"]
            out["left_out"] = sum(f.get("batches_to_skip", 0) for a, f in done if a == "rollback") / micro
            out["repeated"] = float(sum(1 for a, f in done if a == "undo"))
        out["thrown_away"] = thrown_away(events, out["left_out"], out["repeated"])
    if not opts.root:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _child(conn, fn: Callable[..., Any], args: tuple) -> None:
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the table alone goes to stdout
            conn.send(("ok", fn(*args)))
    except BaseException as e:  # the parent reports it as the run's error
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))
    finally:
        conn.close()


def isolated(isolate: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked child: its peak RSS is its own, and a crash is one row's error."""
    if not isolate or "fork" not in multiprocessing.get_all_start_methods():
        return fn(*args)
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args))
    proc.start()
    send.close()
    try:
        status, payload = recv.recv()
    except EOFError:
        status, payload = "error", "the run's process died without a result"
    proc.join()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def run_isolated(model_name: str, arm: Arm, opts: Options) -> dict[str, Any]:
    return isolated(opts.isolate, run_arm, model_name, arm, opts)


def step_time_probe(model_name: str, steps: int, opts: Options) -> dict[str, Any]:
    """Step time at the monitor's defaults on a healthy run, bare and monitored twins trained in one
    process with their steps interleaved (order alternating), so machine noise hits both alike."""
    torch.set_num_threads(1)
    task = TASKS[model_name]()
    runs = []
    with tempfile.TemporaryDirectory() as run_dir:
        for monitored in (False, True):
            torch.manual_seed(opts.seed)
            model, opt = task.build()
            model.to(opts.device)
            mon = None
            if monitored:
                import sfmonitor

                mon = sfmonitor.attach(model, opt, run_dir=run_dir, sinks=["jsonl"], config=monitor_config(opts))
            runs.append((model, opt, mon, []))
        for i, batch in enumerate(task.train_batches(steps + 5, opts.seed)):
            batch = to_device(batch, opts.device)
            for model, opt, mon, times in runs if i % 2 else runs[::-1]:
                torch.manual_seed(step_seed(opts.seed, i))
                sync(opts.device)
                t0 = time.perf_counter()
                loss = task.loss(model, batch)
                float(loss.detach())
                if mon is not None:
                    loss = mon.combine(loss)
                loss.backward()
                if task.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(opts.device)
                if i >= 5:
                    times.append(time.perf_counter() - t0)
        runs[1][2].detach()
    bare, mon_ms = (1e3 * statistics.median(r[3]) for r in runs)
    n_params = sum(p.numel() for p in runs[0][0].parameters())
    return {"model": model_name, "params": n_params, "steps": steps, "bare_ms": bare, "monitored_ms": mon_ms}


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


def scenario_arms(model_name: str, scenario: str, opts: Options) -> dict[str, Arm]:
    """The runs of one model x scenario: ``twin`` (bare, fault-free or with the same evaluations),
    ``mon`` (monitored), ``bare`` (bare with the fault), ``exact`` (the twin the monitored run must
    equal bit for bit, where the rescue should be exact)."""
    driver = "reference" if model_name == "reference" else "loop"
    n = opts.steps
    f = opts.fault_step(n)

    def pair(faults=(), steps=n, **kw):
        return Arm(steps, False, faults, driver=driver, **kw), Arm(steps, True, faults, driver=driver, **kw)

    twin = Arm(n, driver=driver)
    if scenario == "fault_free":
        return {"twin": twin, "mon": pair()[1], "exact": twin}
    if scenario == "bad_every":
        n = opts.long_steps
        faults = tuple(("garbage", s) for s in range(opts.every - 1, n, opts.every))
        twin = Arm(n, driver=driver)
    elif scenario == "bad_labels":
        faults = tuple(("labels", s) for s in range(f, f + max(1, n // 10)))
    elif scenario in ("nan_batch", "lr_spike", "loss_spike", "scaled_batch"):
        faults = (({"nan_batch": "nan", "lr_spike": "lr", "loss_spike": "loss", "scaled_batch": "scale"}[scenario], f),)
    else:
        faults = ()
    if faults:
        bare, mon = pair(faults, steps=n)
        exact = Arm(n, drop=tuple(s for _, s in faults), driver=driver)  # never saw the bad steps
        return {"twin": twin, "bare": bare, "mon": mon, "exact": exact}
    if scenario in ("eval_combine", "lightning", "hf_trainer"):
        d = {"eval_combine": "loop", "lightning": "lightning", "hf_trainer": "hf"}[scenario]
        ref = Arm(n, eval_every=opts.eval_every, driver=d)
        return {"twin": ref, "mon": dataclasses.replace(ref, monitored=True), "exact": ref}
    if scenario == "high_lr":
        s = opts.high_lr_steps
        return {
            "twin": Arm(s, driver=driver),
            "bare": Arm(s, lr_mult=opts.high_lr_mult, driver=driver),
            "mon": Arm(s, True, lr_mult=opts.high_lr_mult, driver=driver),
        }
    raise ValueError(f"unknown scenario {scenario!r}; expected one of {', '.join(SCENARIOS)}")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not math.isfinite(b) or b == 0:
        return None
    return a / b


def final_train(losses: list[tuple[int, float, bool]]) -> float:
    """The mean training loss of the last TRAIN_TAIL healthy steps (no fault injected) with a
    finite loss; NaN when the last step's loss is not finite (the run ends broken)."""
    healthy = [loss for _, loss, bad in losses if not bad]
    if not healthy or not math.isfinite(healthy[-1]):
        return math.nan
    tail = [loss for loss in healthy if math.isfinite(loss)][-TRAIN_TAIL:]
    return statistics.fmean(tail) if tail else math.nan


def first_spike(losses: list[tuple[int, float, bool]]) -> int | None:
    """The first step whose loss is above SPIKE x the lowest loss before it."""
    low = math.inf
    for step, loss, _ in losses:
        if not math.isfinite(loss) or (low < math.inf and loss > SPIKE * low):
            return step
        low = min(low, loss)
    return None


HEALTHY = ("fault_free", "eval_combine", "lightning", "hf_trainer")


def judge(row: dict[str, Any]) -> list[str]:
    """The issue's targets this row misses (empty: met). Reads only the row, so that it also
    judges a row averaged over seeds."""
    scenario = row["scenario"]
    miss = []
    if scenario in HEALTHY:
        if row["n_actions"]:
            miss.append(f"{_n(row['n_actions'])} action(s) on a healthy run")
        if row["identical"] is not None and row["identical"] < 1:
            miss.append("not bit-identical to the bare run")
        return miss
    if row["stopped"]:
        miss.append("stopped")
    if scenario == "high_lr":
        spike, seen = row["spike_step"], row["detected_step"]
        if spike is not None and (seen is None or seen > spike):
            miss.append("spike not detected in its step")
        if row["gap_closed"] is None or row["gap_closed"] < 0.5:
            miss.append("ends less than halfway to the default-LR loss")
        return miss
    if scenario == "bad_every":
        for key in ("eval", "train"):
            mon, bare = row[f"{key}_ratio"], row[f"bare_{key}_ratio"]
            if mon is None or bare is None or not mon <= bare:
                miss.append(f"{key} loss above bare")
        return miss
    for key in ("eval", "train"):
        value = row[f"{key}_ratio"]
        if value is None or not value <= TOLERANCE:
            miss.append(f"{key} loss {_x(value)} the twin")
    if scenario in EXACT and row["identical"] is not None and row["identical"] < 1:
        what = "parameters equal, buffers not" if row["params_identical"] == 1 else "parameters differ"
        miss.append(f"not bit-identical to the twin without the bad step ({what})")
    if scenario in ("lr_spike", "loss_spike") and row["lost"] > 1:
        miss.append(f"{row['lost']:g} steps lost (target <= 1)")
    return miss


def run_scenario(model_name: str, scenario: str, opts: Options, cache: dict | None = None) -> dict[str, Any]:
    """Every run of one model x scenario (runs shared with another scenario come from ``cache``)
    and its row: the numbers, and which of the issue's targets it misses."""
    cache = {} if cache is None else cache
    arms = scenario_arms(model_name, scenario, opts)
    runs: dict[str, dict[str, Any]] = {}
    for role, arm in arms.items():
        key = (model_name, arm, opts.seed)
        if key not in cache:
            print(f"  {model_name} {scenario}: {role} {_arm_str(arm)}", file=sys.stderr, flush=True)
            cache[key] = run_isolated(model_name, arm, opts)
        runs[role] = cache[key]
    mon, twin = runs["mon"], runs["twin"]
    bare, exact = runs.get("bare"), runs.get("exact")
    row: dict[str, Any] = {
        "model": model_name,
        "scenario": scenario,
        "seeds": [opts.seed],
        "steps": arms["mon"].steps,
        "faults": [list(f) for f in arms["mon"].faults],
        "twin_eval_loss": twin["eval_loss"],
        "twin_train_loss": twin["final_train"],
        "eval_loss": mon["eval_loss"],
        "train_loss": mon["final_train"],
        "eval_ratio": ratio(mon["eval_loss"], twin["eval_loss"]),
        "train_ratio": ratio(mon["final_train"], twin["final_train"]),
        "bare_eval_ratio": ratio(bare["eval_loss"], twin["eval_loss"]) if bare else None,
        "bare_train_ratio": ratio(bare["final_train"], twin["final_train"]) if bare else None,
        "exact_eval_ratio": ratio(exact["eval_loss"], twin["eval_loss"]) if exact and exact is not twin else None,
        "identical": float(mon["digest"] == exact["digest"]) if exact else None,
        "params_identical": float(mon["digest"]["params"] == exact["digest"]["params"]) if exact else None,
        "finite": mon["finite"],
        "lost": mon["thrown_away"]["lost"],
        "thrown_away": mon["thrown_away"],
        "n_actions": sum(mon["actions"].values()),
        "actions": mon["actions"],
        "kinds": mon["kinds"],
        "stopped": float(bool(mon["stopped"])),
        "stop_reason": mon["stopped"],
        "peak_rss_mib": mon["peak_rss_mib"],
        "twin_peak_rss_mib": twin["peak_rss_mib"],
        "step_time_ratio": ratio(mon["step_ms"], twin["step_ms"]),
        "seconds": {role: round(r["seconds"], 1) for role, r in runs.items()},
        "events": [{k: e.get(k) for k in ("step", "kind", "actions")} for e in mon["events"][:50]],  # the counts: all
    }
    if scenario == "high_lr":
        row["spike_step"] = first_spike(bare["losses"]) if bare else None
        row["detected_step"] = min((e["step"] for e in mon["events"]), default=None)
        row["detected_kind"] = min(mon["events"], key=lambda e: e["step"])["kind"] if mon["events"] else None
        gap = bare["eval_loss"] - twin["eval_loss"] if bare else None
        row["gap_closed"] = (bare["eval_loss"] - mon["eval_loss"]) / gap if gap and gap > 0 else None
    row["misses"] = judge(row)
    return row


def _mean(values: list[Any]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model x scenario over its seeds: means of the numbers, sums of the counts
    (actions, events), the latest spike and detection, and the targets judged on the means."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["scenario"]), []).append(r)
    out = []
    for rs in groups.values():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out.append(rs[0])
            continue
        agg = dict(ok[0])
        agg["seeds"] = [s for r in ok for s in r["seeds"]]
        for key, value in ok[0].items():
            if key in ("steps", "seeds") or isinstance(value, list):
                continue
            texts = [r[key] for r in ok if isinstance(r[key], str)]
            if texts:  # a text field (the first event's kind): the first seed's that has one
                agg[key] = texts[0]
                continue
            if isinstance(value, dict):
                if key in ("actions", "kinds"):
                    agg[key] = dict(sum((Counter(r[key]) for r in ok), Counter()))
                elif key == "thrown_away":
                    agg[key] = {k: _mean([r[key][k] for r in ok]) for k in value}
                continue
            if key in ("spike_step", "detected_step"):
                vals = [r[key] for r in ok]
                agg[key] = None if any(v is None for v in vals) else max(vals)
            elif isinstance(value, (int, float)) or value is None:
                agg[key] = _mean([r[key] for r in ok])
        agg["errors"] = len(rs) - len(ok)
        agg["misses"] = judge(agg) + ([f"{agg['errors']} run(s) failed"] if agg["errors"] else [])
        out.append(agg)
    return out


def _arm_str(arm: Arm) -> str:
    parts = [arm.driver, f"{arm.steps} steps", "monitored" if arm.monitored else "bare"]
    if arm.faults:
        kinds = sorted({k for k, _ in arm.faults})
        parts.append(f"{'+'.join(kinds)} at {len(arm.faults)} step(s) from {arm.faults[0][1]}")
    if arm.drop:
        parts.append(f"without step(s) {list(arm.drop)}")
    if arm.lr_mult != 1:
        parts.append(f"LR x{arm.lr_mult:g}")
    if arm.eval_every:
        parts.append(f"eval every {arm.eval_every}")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------


def _x(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}x" if math.isfinite(v) else str(v)


def _f(v: float | None, fmt: str = ".3f") -> str:
    if v is None:
        return "-"
    return format(v, fmt) if math.isfinite(v) else str(v)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {_n(n)}" for k, n in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))) or "0"


def _n(v: float | None) -> str:
    """A count or a mean of counts."""
    if v is None:
        return "-"
    return f"{v:g}" if float(v).is_integer() else f"{v:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown row per model x scenario. Ratios are to the fault-free twin (the bare run of the
    same seed and data; for the healthy scenarios, with the same evaluations)."""
    out = [
        "| model | scenario | steps | eval loss of the twin | monitored: eval / twin | monitored: train / twin | "
        "bare with the fault: eval / twin | bare without the bad steps: eval / twin | bit-identical | "
        "steps lost (undone/skipped/left out/re-used) | actions | events | stopped | "
        "peak RSS MiB, monitored (twin) | step time / twin | targets missed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['scenario']} | error: {r['error'].splitlines()[0][:150]} |" + " |" * 13)
            continue
        t = r["thrown_away"]
        n = len(r["seeds"])
        if r["identical"] is None:
            identical = "-"
        elif r["identical"] == 1:
            identical = "yes"
        elif r["params_identical"] == 1:
            identical = "parameters only"
        else:
            identical = "no"
        if n > 1 and r["identical"] is not None and 0 < r["identical"] < 1:
            identical = f"{round(r['identical'] * n)}/{n}"
        if identical != "yes" and r["scenario"] in (*HEALTHY, *EXACT):  # where the target asks for it
            identical = f"**{identical}**"
        extra = ""
        if r["scenario"] == "high_lr":
            kind = f" ({r['detected_kind']})" if r.get("detected_kind") else ""
            gap = "-" if r["gap_closed"] is None else format(r["gap_closed"], ".0%")
            extra = (
                f"spike at step {_n(r['spike_step'])}, first event at step {_n(r['detected_step'])}{kind}, "
                f"gap closed {gap}; "
            )
        stopped = "-" if not r["stopped"] else ("**yes**" if n == 1 else f"**{round(r['stopped'] * n)}/{n}**")
        misses = "; ".join(r["misses"]) if r["misses"] else "none"
        out.append(
            f"| {r['model']} | {r['scenario']} | {r['steps']} | {_f(r['twin_eval_loss'])} "
            f"| {_x(r['eval_ratio'])} | {_x(r['train_ratio'])} | {_x(r['bare_eval_ratio'])} "
            f"| {_x(r['exact_eval_ratio'])} | {identical} "
            f"| {_n(r['lost'])} ({_n(t['undone'])}/{_n(t['skipped'])}/{_n(t['left_out'])}/{_n(t['repeated'])}) "
            f"| {_counts(r['actions'])} | {_counts(r['kinds'])} | {stopped} "
            f"| {r['peak_rss_mib']:.0f} ({r['twin_peak_rss_mib']:.0f}) | {_x(r['step_time_ratio'])} "
            f"| {extra}{misses} |"
        )
    return "\n".join(out)


def probe_table(probes: list[dict[str, Any]]) -> str:
    out = [
        "| model | parameters | bare ms/step | monitored ms/step | ratio (interleaved, median) |",
        "|---|---|---|---|---|",
    ]
    for r in probes:
        out.append(
            f"| {r['model']} | {r['params'] / 1e3:.0f}k | {r['bare_ms']:.1f} | {r['monitored_ms']:.1f} "
            f"| {r['monitored_ms'] / r['bare_ms']:.3f}x |"
        )
    return "\n".join(out)


def summary(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "error" not in r and not r["misses"]]
    return f"{len(ok)} of {len(rows)} rows meet their targets"


def _states(start: str, end: str) -> str:
    return start if start == end else f"{start} at the start, {end} at the end (changed during the run)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--quick", action="store_true", help=f"a subset in under a minute: {QUICK}")
    p.add_argument("--steps", type=int, default=None, help="steps of a run (default 100; --quick 60)")
    p.add_argument("--long-steps", type=int, default=300, help="steps of the bad_every runs")
    p.add_argument("--every", type=int, default=20, help="bad_every: one bad batch every this many steps")
    p.add_argument("--eval-every", type=int, default=20, help="healthy runs: an evaluation every this many steps")
    p.add_argument("--high-lr-mult", type=float, default=20.0, help="high_lr: x the GPT's default LR")
    p.add_argument("--high-lr-steps", type=int, default=150)
    p.add_argument("--seeds", default="0", help="comma list of seeds (one row per seed)")
    p.add_argument("--monitor-config", default=None, help="monitor config for every monitored run (JSON or YAML)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--keep", default=None, help="keep each run's folder (events.jsonl, metrics.jsonl) under this")
    p.add_argument("--probe-steps", type=int, default=60, help="steps of the interleaved step-time probe")
    p.add_argument("--no-probe", action="store_true", help="skip the interleaved step-time probe")
    p.add_argument("--no-isolate", action="store_true", help="run in this process (peak RSS is then cumulative)")
    p.add_argument("--show", default=None, help="print the tables of a JSON file written by --json, run nothing")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the loop and reference runs train (cpu, cuda, cuda:1, ...); on a GPU with "
        "deterministic algorithms, so that twins can be bit-identical",
    )
    args = p.parse_args(argv)
    if args.show:
        with open(args.show, encoding="utf-8") as fh:
            saved = json.load(fh)
        print(saved["header"])
        print(table(saved["table"]))
        print()
        print(summary(saved["table"]))
        if saved.get("step_time"):
            print()
            print(probe_table(saved["step_time"]))
        return 0
    models = (QUICK["models"] if args.quick and args.models == ",".join(MODELS) else args.models).split(",")
    default_scen = ",".join(SCENARIOS)
    scenarios = (QUICK["scenarios"] if args.quick and args.scenarios == default_scen else args.scenarios).split(",")
    bad = [m for m in models if m not in MODELS] + [s for s in scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown model or scenario: {', '.join(bad)}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device!r}: {e}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: only cpu and cuda are supported")
    if device.type == "cuda":
        cpu_only = sorted({"lightning", "hf_trainer"} & set(scenarios))
        if cpu_only:
            p.error(f"--device {args.device}: {', '.join(cpu_only)} train on the CPU only; leave them out")
        if not torch.cuda.is_available():
            p.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here")
        # Before CUDA starts: cuBLAS needs this workspace to be deterministic. Bare and monitored
        # twins can then end bit-identical, as on the CPU.
        # warn_only: an op with no deterministic kernel warns (and its row may differ) instead of
        # ending the run.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    mcfg: dict[str, Any] = {}
    if args.monitor_config:
        text = args.monitor_config
        if not text.lstrip().startswith("{"):
            with open(text, encoding="utf-8") as fh:
                text = fh.read()
        import yaml

        mcfg = yaml.safe_load(text) or {}
    steps = args.steps or (QUICK["steps"] if args.quick else 100)
    root = os.path.abspath(args.keep) if args.keep else ""
    if root:
        os.makedirs(root, exist_ok=True)
    torch.set_num_threads(1)
    if any(m in ("bert",) for m in models) or "hf_trainer" in scenarios:
        with contextlib.suppress(ImportError):
            import transformers  # noqa: F401 - imported once here, inherited by every forked run
    if "lightning" in scenarios:
        with contextlib.suppress(ImportError):
            import lightning.pytorch  # noqa: F401
    import reference_model.train  # noqa: F401
    import sfmonitor  # noqa: F401

    state_at_start = _checkout.describe()
    rows: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    for seed in seeds:
        opts = Options(
            steps=steps,
            long_steps=args.long_steps,
            every=args.every,
            eval_every=args.eval_every,
            high_lr_mult=args.high_lr_mult,
            high_lr_steps=args.high_lr_steps,
            seed=seed,
            monitor_config=mcfg,
            isolate=not args.no_isolate,
            root=root,
            device=str(device),
        )
        cache: dict = {}
        for model_name in models:
            for scenario in scenarios:
                if scenario not in APPLIES[model_name]:
                    continue
                try:
                    rows.append(run_scenario(model_name, scenario, opts, cache))
                except Exception as e:
                    rows.append({"model": model_name, "scenario": scenario, "seeds": [seed], "error": str(e)})
                    print(f"  {model_name} {scenario}: error {e}", file=sys.stderr, flush=True)
        if seed == seeds[0] and not args.no_probe:
            for model_name in models:
                if model_name == "reference":
                    continue  # its own trainer's loop: nothing to interleave
                print(f"  {model_name}: step time probe", file=sys.stderr, flush=True)
                try:
                    probes.append(isolated(opts.isolate, step_time_probe, model_name, args.probe_steps, opts))
                except Exception as e:
                    print(f"  {model_name}: step time probe failed: {e}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    header = (
        f"# faults benchmark: sfmonitor at {_states(state_at_start, _checkout.describe())}, "
        f"torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPU(s), 1 thread per run, seeds {args.seeds}; {seconds:.0f} s"
        + (f"; device {torch.cuda.get_device_name(device)}, deterministic algorithms" if device.type == "cuda" else "")
    )
    shown = aggregate(rows) if len(seeds) > 1 else rows
    print(header)
    print(table(shown))
    print()
    print(summary(shown))
    if probes:
        print()
        print(probe_table(probes))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            record = {"header": header, "argv": sys.argv[1:] if argv is None else argv, "rows": rows, "table": shown}
            json.dump({**record, "step_time": probes}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
