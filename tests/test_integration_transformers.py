"""sfmonitor.integrations.transformers: the monitor inside a real HF Trainer (CPU, tiny local GPT-2)."""

import json
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _integration_helpers import SEQ, VOCAB, Tokens, monitor_hooks, same, same_state  # noqa: E402

from sfmonitor import ConfigError, Monitor  # noqa: E402
from sfmonitor.events import NONFINITE_GRAD, NONFINITE_LOSS, PLATEAU, SKIP_STEP, STOP  # noqa: E402
from sfmonitor.integrations.transformers import (  # noqa: E402
    SFMonitorTrainerCallback,
    inner_optimizer,
    micro_batches_in_loss,
)

NAN_STEP = 2
N_STEPS = 5
QUIET = {"console": False}


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def inject_nan(model, at_forward):
    """The token embedding returns NaN in the training forward number ``at_forward`` (0-based)."""
    calls = {"n": 0}

    def hook(module, inputs, output):
        if not module.training:
            return None
        n = calls["n"]
        calls["n"] += 1
        return output * float("nan") if n == at_forward else None

    return model.transformer.wte.register_forward_hook(hook)


class Recorder(transformers.TrainerCallback):
    """Parameters and optimizer state before and after every optimizer step."""

    def __init__(self):
        self.before, self.after, self.state_before, self.state_after = {}, {}, {}, {}

    @staticmethod
    def _opt_state(optimizer):
        return {
            k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
            for k, s in inner_optimizer(optimizer).state.items()
        }

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self.before[state.global_step] = [p.detach().clone() for p in model.parameters()]
        self.state_before[state.global_step] = self._opt_state(optimizer)

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self.after[state.global_step] = [p.detach().clone() for p in model.parameters()]
        self.state_after[state.global_step] = self._opt_state(optimizer)


def make_trainer(tmp_path, model, callbacks, steps=N_STEPS, eval_steps=None, trainer_cls=None, **kw):
    kw = {"learning_rate": 1e-2, "logging_strategy": "no", **kw}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=4,
        max_steps=steps,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        per_device_eval_batch_size=4,
        **kw,
    )
    return (trainer_cls or transformers.Trainer)(
        model=model,
        args=args,
        train_dataset=Tokens(4 * steps),
        callbacks=callbacks,
        eval_dataset=Tokens(4) if eval_steps else None,
    )


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_nan_step_is_skipped_bit_identically(tmp_path, max_grad_norm):
    cb = SFMonitorTrainerCallback(run_dir=tmp_path / "run", config=QUIET)
    assert isinstance(cb.monitor, Monitor)
    rec = Recorder()
    model = tiny_gpt2()
    inject_nan(model, NAN_STEP)
    t = make_trainer(tmp_path, model, [cb, rec], max_grad_norm=max_grad_norm)
    t.train()

    assert same(rec.before[NAN_STEP], rec.after[NAN_STEP])
    assert same_state(rec.state_before[NAN_STEP], rec.state_after[NAN_STEP])
    for i in range(N_STEPS):
        if i != NAN_STEP:
            assert not same(rec.before[i], rec.after[i]), i
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ev = [e for e in cb.monitor.events if e.kind == NONFINITE_GRAD]
    assert [e.step for e in ev] == [NAN_STEP]
    assert SKIP_STEP in ev[0].actions
    if max_grad_norm == 0:  # raw gradients: the NaN enters at the token embedding
        assert ev[0].data["param"] == "transformer.wte.weight"
    assert cb.monitor.step == N_STEPS
    stats = cb.monitor.stats
    # A GPT is a single trunk (`transformer`; the tied lm_head holds no parameter of its own): its
    # groups follow the structure below it, one per block plus embeddings and the final norm.
    for key in ("grad_norm/total", "grad_norm/wte", "grad_norm/h.0", "param_norm/ln_f", "lr/0"):
        assert key in stats, key
    assert "grad_norm/transformer" not in stats
    assert stats["update_ratio/h.0"] > 0
    # detached at train end: nothing left on the torch optimizer inside accelerate's wrapper
    assert cb.monitor.model is None
    assert monitor_hooks(inner_optimizer(t.optimizer)) == []


def test_hooks_on_the_inner_optimizer_while_training(tmp_path):
    cb = SFMonitorTrainerCallback(run_dir=tmp_path / "run", config=QUIET)
    seen = {}

    class Peek(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kw):
            seen["inner"] = len(monitor_hooks(inner_optimizer(optimizer)))
            seen["same"] = cb.monitor.optimizer is inner_optimizer(optimizer)

    make_trainer(tmp_path, tiny_gpt2(), [cb, Peek()], steps=2).train()
    assert seen == {"inner": 2, "same": True}
    assert cb.monitor.events == []  # a healthy run records nothing


def test_losses_through_compute_loss(tmp_path):
    cb = SFMonitorTrainerCallback(run_dir=tmp_path / "run", config=QUIET)

    class Combined(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
            if return_outputs:
                return cb.monitor.combine(out[0]), out[1]
            return cb.monitor.combine(out)

    model = tiny_gpt2()
    inject_nan(model, NAN_STEP)
    make_trainer(tmp_path, model, [cb], trainer_cls=Combined).train()
    kinds = {e.kind: e.step for e in cb.monitor.events}
    assert kinds[NONFINITE_LOSS] == NAN_STEP
    assert 0 < cb.monitor.stats["loss/total"] < 10


class StepLosses(transformers.TrainerCallback):
    """The Trainer's own loss of each optimizer step (``logging_steps=1``)."""

    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


@pytest.mark.parametrize("components", [False, True])
def test_loss_statistics_match_the_trainers_loss_under_gradient_accumulation(tmp_path, components):
    """GPT-2 takes ``num_items_in_batch``: with gradient accumulation each micro-batch's loss is
    normalised to the whole accumulated batch, and the micro-batch losses add up to the step's.
    Through ``cb.combine(..., trainer=self, num_items_in_batch=...)`` ``loss/total`` is that
    loss, as the Trainer reports it (not divided by the accumulation steps), for a loss or a dict
    of components; the run itself is bit-identical to one without the monitor."""
    cb = SFMonitorTrainerCallback(run_dir=tmp_path / "run", config=QUIET)

    class Combined(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            if components:
                loss = cb.combine({"lm": loss}, {"lm": 1.0}, trainer=self, num_items_in_batch=num_items_in_batch)
            else:
                loss = cb.combine(loss, trainer=self, num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss

    kw = {"gradient_accumulation_steps": 2, "logging_strategy": "steps", "logging_steps": 1}
    theirs = StepLosses()
    # 12 sequences, 4 a micro-batch: 2 optimizer steps an epoch, the second with 1 micro-batch
    t = make_trainer(tmp_path, tiny_gpt2(), [cb, theirs], steps=3, trainer_cls=Combined, **kw)
    t.train()
    assert t.model_accepts_loss_kwargs  # each micro-batch loss is normalised to the whole batch
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == len(theirs.losses) == 3
    assert [r["loss/total"] for r in rows] == pytest.approx(theirs.losses, rel=1e-4)
    if components:
        assert [r["loss/lm"] for r in rows] == pytest.approx(theirs.losses, rel=1e-4)
    # what the Trainer backpropagated is untouched, and what it reported too (to rounding)
    bare_losses = StepLosses()
    bare = make_trainer(tmp_path / "bare", tiny_gpt2(), [bare_losses], steps=3, **kw)
    bare.train()
    assert same(list(bare.model.parameters()), list(t.model.parameters()))
    assert bare_losses.losses == pytest.approx(theirs.losses, rel=1e-6)


def test_combine_scales_the_record_not_the_gradients():
    """``cb.combine`` with n = 3 micro-batches, without a Trainer run: the gradients are those of
    the plain weighted sum (a learnable weight's too), and so is the value, to the last bit: the
    value was the scaled record's total divided by 3, which rounds differently on a third of the
    draws (a Trainer's reported loss differed from the bare run's, its weights did not)."""
    from types import SimpleNamespace

    cb = SFMonitorTrainerCallback(config=QUIET)
    trainer = SimpleNamespace(
        loss_is_scaled_for_ga=None,
        model_accepts_loss_kwargs=True,
        compute_loss_func=None,
        current_gradient_accumulation_steps=3,
        args=SimpleNamespace(gradient_accumulation_steps=3),
    )
    x = torch.nn.Parameter(torch.tensor([0.3, 1.7]))
    loss = cb.combine({"a": (x**2).sum(), "b": x.sum()}, {"a": 0.5, "b": 2.0}, trainer=trainer, num_items_in_batch=5)
    loss.backward()
    got = x.grad.clone()
    x.grad = None
    (0.5 * (x**2).sum() + 2.0 * x.sum()).backward()
    assert torch.equal(got, x.grad)
    assert loss.item() == pytest.approx(0.5 * 0.3**2 + 0.5 * 1.7**2 + 2.0 * 2.0, rel=1e-6)
    recorded = cb.monitor._record.losses.entries[-1]
    assert recorded.total.item() == pytest.approx(3 * loss.item(), rel=1e-6)  # the record: x 3
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a, b = torch.rand(2, generator=g).tolist()
        va, vb = torch.tensor(a), torch.tensor(b)
        got = cb.combine({"a": va, "b": vb}, {"a": 0.7, "b": 1.3}, trainer=trainer, num_items_in_batch=5)
        assert torch.equal(got, 0.7 * va + 1.3 * vb), (a, b)

    w = torch.nn.Parameter(torch.tensor(0.5))
    cb.combine({"a": (x**2).sum()}, {"a": w}, trainer=trainer, num_items_in_batch=5).backward()
    assert w.grad.item() == pytest.approx(0.3**2 + 1.7**2)
    assert cb.monitor._record.losses.entries[-1].components["a"].item() == pytest.approx(3 * (0.3**2 + 1.7**2))
    # the Trainer's own test: a per-micro-batch mean (no num_items_in_batch) is recorded as it is
    assert micro_batches_in_loss(trainer, 5) == 3 and micro_batches_in_loss(trainer, None) == 1
    assert micro_batches_in_loss(SimpleNamespace(**{**vars(trainer), "model_accepts_loss_kwargs": False}), 5) == 1
    assert micro_batches_in_loss(SimpleNamespace(**{**vars(trainer), "loss_is_scaled_for_ga": True}), None) == 3


def test_plateau_sets_should_training_stop(tmp_path):
    early_stopping = {"rungs": [{"after": 1, "actions": ["lr_drop"]}, {"after": 2, "actions": ["stop"]}]}
    cfg = {
        **QUIET,
        "detectors": {"plateau": {"patience": 1, "grace": 1}},
        "policy": {"ladders": {"plateau": early_stopping}},
    }
    cb = SFMonitorTrainerCallback(run_dir=tmp_path / "run", config=cfg)
    # learning rate 0: nothing learns, so the eval loss stays the same
    t = make_trainer(tmp_path, tiny_gpt2(), [cb], steps=20, eval_steps=1, learning_rate=0.0)
    t.train()
    plateaus = [e for e in cb.monitor.events if e.kind == PLATEAU]
    assert len(plateaus) == 2 and STOP in plateaus[-1].actions
    assert cb.monitor.should_stop
    assert t.state.global_step == 3  # evaluations after steps 1, 2, 3: stop after the third


def test_eval_metric_mapping_is_checked():
    with pytest.raises(ConfigError, match="eval_metrics"):
        SFMonitorTrainerCallback(eval_metrics={"eval_loss": 1})
    with pytest.raises(ConfigError):
        SFMonitorTrainerCallback(config={"no_such_key": 1})


def test_stop_training_becomes_a_graceful_stop(tmp_path):
    cfg = {**QUIET, "policy": {"ladders": {"nonfinite_grad": {"rungs": [{"after": 1, "actions": ["stop"]}]}}}}
    cb = SFMonitorTrainerCallback(run_dir=tmp_path / "run", config=cfg)
    rec = Recorder()
    model = tiny_gpt2()
    inject_nan(model, NAN_STEP)
    t = make_trainer(tmp_path, model, [cb, rec], steps=N_STEPS)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t.train()
    assert cb.stop_reason and f"stopped training at step {NAN_STEP}" in cb.stop_reason
    assert any("stopped training" in str(x.message) for x in w)
    assert same(rec.before[NAN_STEP], rec.after[NAN_STEP])
    assert t.state.global_step == NAN_STEP + 1
    assert cb.monitor.model is None


def test_import_sfmonitor_does_not_import_transformers():
    import subprocess

    code = (
        "import sys, sfmonitor, sfmonitor.integrations; "
        "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_transformers_gives_the_install_hint():
    import subprocess

    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import sfmonitor.integrations.transformers\nexcept ImportError as e:\n"
        "    assert \"pip install 'sfmonitor[transformers]'\" in str(e), e\nelse:\n    raise SystemExit('no error')"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
