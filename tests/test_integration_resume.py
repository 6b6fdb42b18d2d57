"""Resuming a Lightning / transformers run from its checkpoint resumes the monitor with it: a run
stopped and resumed is the same monitored run as one left uninterrupted (CPU, tiny models).

The run: a NaN step makes the monitor roll back and drop the LR (lr_scale 0.2; a ladder that does
so at once), and the LR climbs back (``recover_after`` / ``recover_steps``) across the checkpoint.
A resumed monitor that started afresh would train at the full LR again: the weights would differ."""

import json

import pytest
import torch
from _integration_helpers import SEQ, VOCAB, Tokens, same
from torch import nn

QUIET = {"console": False}
NAN_STEP = 2
# a NaN step: rollback and lr_drop; the LR climbs back from 4 steps after the drop, over 6 steps
CFG = {
    **QUIET,
    "policy": {"ladders": {"nonfinite_grad": {"rungs": [{"after": 1, "actions": ["rollback", "lr_drop"]}]}}},
    "actions": {"lr_drop": {"recover_after": 4, "recover_steps": 6}},
}
ROLLBACK = "rollback"


def metrics_steps(run_dir):
    return [json.loads(line)["step"] for line in open(f"{run_dir}/metrics.jsonl")]


def events_from(cb, step):
    return [(e.step, e.kind, e.actions, e.message) for e in cb.monitor.events if e.step >= step]


# ---------------------------------------------------------------------------------------------
# Lightning
# ---------------------------------------------------------------------------------------------


def lightning_parts():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from sfmonitor.integrations.lightning import SFMonitorCallback

    class Tiny(pl.LightningModule):
        def __init__(self, nan_at=()):
            super().__init__()
            torch.manual_seed(0)
            self.enc = nn.Linear(4, 8)
            self.head = nn.Linear(8, 1)
            self.nan_at = set(nan_at)  # (epoch, batch_idx)

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.head(torch.relu(self.enc(x)))
            if (self.current_epoch, batch_idx) in self.nan_at:
                out = out * float("nan")
            return nn.functional.mse_loss(out, y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    def loader(n=6):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4 * n, 4, generator=g)
        ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)

    def trainer(callbacks, max_epochs, **kw):
        return pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=max_epochs,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            **kw,
        )

    return pl, Tiny, loader, trainer, ModelCheckpoint, SFMonitorCallback


def test_lightning_resume_equals_the_uninterrupted_run(tmp_path):
    pl, Tiny, loader, trainer, ModelCheckpoint, SFMonitorCallback = lightning_parts()
    nan_at = {(0, NAN_STEP)}

    whole = SFMonitorCallback(run_dir=tmp_path / "whole", config=CFG)
    m_whole = Tiny(nan_at)
    trainer([whole], max_epochs=3).fit(m_whole, loader())

    # the same run, stopped after its first epoch (6 steps) ...
    first = SFMonitorCallback(run_dir=tmp_path / "run", config=CFG)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    trainer([first, ckpt], max_epochs=1).fit(Tiny(nan_at), loader())
    assert [e.step for e in first.monitor.events if ROLLBACK in e.actions] == [NAN_STEP]
    assert first.monitor.state_dict()["lr_scale"] < 1
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["callbacks"]["SFMonitorCallback"]["monitor"]["step"] == 6

    # ... and resumed in a new process-like setting: new module, new callback, same run_dir
    resumed = SFMonitorCallback(run_dir=tmp_path / "run", config=CFG)
    steps_seen = []

    class Peek(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            steps_seen.append((trainer.global_step, resumed.monitor.step, resumed.monitor.state_dict()["lr_scale"]))

    m_resumed = Tiny()
    trainer([resumed, Peek()], max_epochs=3).fit(m_resumed, loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")

    # the rescue made before the checkpoint carries on: the LR scale it left, its step numbers
    assert steps_seen[0] == (6, 6, first.monitor.state_dict()["lr_scale"])
    assert same(list(m_whole.parameters()), list(m_resumed.parameters()))
    assert resumed.monitor.step == whole.monitor.step == 18
    a, b = whole.monitor.state_dict(), resumed.monitor.state_dict()
    for key in ("lr_scale", "lr_recovery", "policy", "step"):
        assert a[key] == b[key], key
    # the LR climbs back at the same steps (from step 6, the first one after the checkpoint)
    assert events_from(whole, 6) == events_from(resumed, 6) and events_from(resumed, 6)
    # one metrics file for the run, each step once
    assert metrics_steps(tmp_path / "run") == list(range(18))


def test_lightning_resume_from_a_checkpoint_without_monitor_state(tmp_path):
    pl, Tiny, loader, trainer, ModelCheckpoint, SFMonitorCallback = lightning_parts()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    trainer([ckpt], max_epochs=1).fit(Tiny(), loader())  # a run made without the monitor

    cb = SFMonitorCallback(run_dir=tmp_path / "run", config=QUIET)
    with pytest.warns(RuntimeWarning, match="no sfmonitor state"):
        trainer([cb], max_epochs=2).fit(Tiny(), loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    # the monitor starts fresh, but numbers its steps as the trainer does
    assert metrics_steps(tmp_path / "run") == list(range(6, 12))


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


def hf_parts():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from sfmonitor.integrations.transformers import SFMonitorTrainerCallback

    class NanAt(transformers.TrainerCallback):
        """The token embedding returns NaN in the training forwards of the optimizer steps
        ``steps`` (global_step numbering), whatever step the run started from."""

        def __init__(self, model, steps):
            self.steps, self.step = set(steps), -1
            model.transformer.wte.register_forward_hook(self.hook)

        def on_step_begin(self, args, state, control, **kw):
            self.step = state.global_step

        def hook(self, module, inputs, output):
            return output * float("nan") if module.training and self.step in self.steps else None

    def make(out_dir, callbacks, model, steps=12, save_steps=None):
        args = transformers.TrainingArguments(
            output_dir=str(out_dir),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=steps,
            learning_rate=1e-2,
            lr_scheduler_type="linear",
            report_to=[],
            use_cpu=True,
            save_strategy="steps" if save_steps else "no",
            save_steps=save_steps or 500,
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        return transformers.Trainer(model=model, args=args, train_dataset=Tokens(8 * steps), callbacks=callbacks)

    def gpt2():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2)
        return transformers.GPT2LMHeadModel(cfg)

    return make, gpt2, NanAt, SFMonitorTrainerCallback


def test_transformers_resume_equals_the_uninterrupted_run(tmp_path):
    make, gpt2, NanAt, SFMonitorTrainerCallback = hf_parts()
    nan_steps = (NAN_STEP,)

    # the whole run, checkpointed every 6 steps
    whole = SFMonitorTrainerCallback(run_dir=tmp_path / "whole", config=CFG)
    model = gpt2()
    t_whole = make(tmp_path / "a", [whole, NanAt(model, nan_steps)], model, save_steps=6)
    t_whole.train()
    assert [e.step for e in whole.monitor.events if ROLLBACK in e.actions] == [NAN_STEP]
    assert (tmp_path / "a" / "checkpoint-6" / "sfmonitor_state.pt").is_file()

    # resumed from its checkpoint-6 by another Trainer, writing elsewhere (another output_dir)
    resumed = SFMonitorTrainerCallback(run_dir=tmp_path / "resumed", config=CFG)
    model = gpt2()
    t_resumed = make(tmp_path / "b", [resumed, NanAt(model, nan_steps)], model)
    t_resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-6"))

    assert same(list(t_whole.model.parameters()), list(t_resumed.model.parameters()))
    assert resumed.monitor.step == whole.monitor.step == 12
    a, b = whole.monitor.state_dict(), resumed.monitor.state_dict()
    for key in ("lr_scale", "lr_recovery", "policy", "step"):
        assert a[key] == b[key], key
    assert events_from(whole, 6) == events_from(resumed, 6) and events_from(resumed, 6)
    assert metrics_steps(tmp_path / "resumed") == list(range(6, 12))


def test_transformers_resume_from_a_checkpoint_without_monitor_state(tmp_path):
    make, gpt2, NanAt, SFMonitorTrainerCallback = hf_parts()
    make(tmp_path / "a", [], gpt2(), steps=6, save_steps=3).train()  # a run made without the monitor

    cb = SFMonitorTrainerCallback(run_dir=tmp_path / "run", config=QUIET)
    with pytest.warns(RuntimeWarning, match="no sfmonitor state"):
        make(tmp_path / "b", [cb], gpt2(), steps=6).train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    # the monitor starts fresh, but numbers its steps as the Trainer does
    assert metrics_steps(tmp_path / "run") == [3, 4, 5]


def test_transformers_checkpoint_folder_without_a_trainer_in_the_stack(tmp_path):
    """Called outside ``Trainer.train()``: ``args.resume_from_checkpoint`` when it is a folder,
    else ``<output_dir>/checkpoint-<global_step>``."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from sfmonitor.integrations.transformers import resumed_from

    state = SimpleNamespace(global_step=6)
    args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint=None)
    assert resumed_from(args, state) == str(tmp_path / "checkpoint-6")
    (tmp_path / "elsewhere").mkdir()
    args.resume_from_checkpoint = str(tmp_path / "elsewhere")
    assert resumed_from(args, state) == str(tmp_path / "elsewhere")
