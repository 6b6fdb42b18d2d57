"""sfmonitor.integrations.lightning: the monitor inside a real Lightning Trainer (CPU, tiny model)."""

import sys
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from _integration_helpers import monitor_hooks, same, same_state  # noqa: E402

from sfmonitor import ConfigError, Monitor  # noqa: E402
from sfmonitor.events import NONFINITE_GRAD, NONFINITE_LOSS, PLATEAU, SKIP_STEP, STOP  # noqa: E402
from sfmonitor.integrations.lightning import SFMonitorCallback  # noqa: E402

NAN_BATCH = 3
N_BATCHES = 6
QUIET = {"console": False}


class Tiny(pl.LightningModule):
    def __init__(self, nan_batch=None, combine=None, fail_at=None, val_losses=None, optimizer="adam"):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.nan_batch, self.combine, self.fail_at = nan_batch, combine, fail_at
        self.val_losses = list(val_losses or [])
        self.opt_name = optimizer

    def forward(self, x):
        return self.head(torch.relu(self.enc(x)))

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        x, y = batch
        out = self(x)
        if batch_idx == self.nan_batch:  # a NaN from inside the model (a NaN input is a bad_batch)
            out = out * float("nan")
        loss = nn.functional.mse_loss(out, y)
        if self.combine is not None:
            return self.combine.monitor.combine(
                {"mse": loss, "l1": self.enc.weight.abs().mean()}, weights={"mse": 1.0, "l1": 0.01}
            )
        return loss

    def validation_step(self, batch, batch_idx):
        value = self.val_losses[self.current_epoch] if self.val_losses else 1.0
        self.log("val_loss", torch.tensor(value))

    def configure_optimizers(self):
        if self.opt_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader(n=N_BATCHES):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * n, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)


class Recorder(pl.Callback):
    """Parameters and optimizer state before and after every training batch."""

    def __init__(self):
        self.before, self.after, self.state_before, self.state_after = {}, {}, {}, {}

    @staticmethod
    def _opt_state(trainer):
        return {
            k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
            for k, s in trainer.optimizers[0].state.items()
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[batch_idx] = [p.detach().clone() for p in pl_module.parameters()]
        self.state_before[batch_idx] = self._opt_state(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[batch_idx] = [p.detach().clone() for p in pl_module.parameters()]
        self.state_after[batch_idx] = self._opt_state(trainer)


def trainer(callbacks, precision="32-true", max_epochs=1, val=False, **kw):
    if precision is not None:
        kw["precision"] = precision
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1 if val else 0,
        **kw,
    )


@pytest.mark.parametrize("precision,opt", [("32-true", "adam"), ("32-true", "sgd"), ("bf16-mixed", "adam")])
def test_nan_batch_is_skipped_bit_identically(tmp_path, precision, opt):
    cb = SFMonitorCallback(run_dir=tmp_path, config=QUIET)
    assert isinstance(cb.monitor, Monitor)
    rec = Recorder()
    model = Tiny(nan_batch=NAN_BATCH, optimizer=opt)
    t = trainer([cb, rec], precision=precision)
    t.fit(model, loader())

    # The NaN step left parameters and optimizer state exactly as they were ...
    assert same(rec.before[NAN_BATCH], rec.after[NAN_BATCH])
    assert same_state(rec.state_before[NAN_BATCH], rec.state_after[NAN_BATCH])
    # ... and every other step did update them (the monitor is not skipping everything).
    for i in range(N_BATCHES):
        if i != NAN_BATCH:
            assert not same(rec.before[i], rec.after[i]), i
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The event names the step (0-based optimizer step == batch index here) and the skip.
    ev = [e for e in cb.monitor.events if e.kind == NONFINITE_GRAD]
    assert [e.step for e in ev] == [NAN_BATCH]
    assert SKIP_STEP in ev[0].actions
    assert ev[0].data["param"].startswith("enc.")  # the first parameter walking the model
    assert cb.monitor.step == N_BATCHES
    stats = cb.monitor.stats
    for key in ("grad_norm/total", "grad_norm/enc", "grad_norm/head", "param_norm/enc", "lr/0"):
        assert key in stats, key
    assert stats["update_ratio/enc"] > 0


def test_losses_through_combine_and_nonfinite_loss_event(tmp_path):
    cb = SFMonitorCallback(run_dir=tmp_path, config=QUIET)
    model = Tiny(nan_batch=NAN_BATCH, combine=cb)
    trainer([cb]).fit(model, loader())
    kinds = {e.kind: e.step for e in cb.monitor.events}
    assert kinds[NONFINITE_LOSS] == NAN_BATCH
    stats = cb.monitor.stats
    assert stats["loss_weight/l1"] == 0.01
    assert stats["loss/mse"] > 0 and "loss/total" in stats


def test_gradient_accumulation_runs_once_per_optimizer_step(tmp_path):
    cb = SFMonitorCallback(run_dir=tmp_path, config=QUIET)
    rec = Recorder()
    model = Tiny(nan_batch=NAN_BATCH)  # batches 2 and 3 form optimizer step 1
    trainer([cb, rec], accumulate_grad_batches=2).fit(model, loader())
    assert cb.monitor.step == N_BATCHES // 2
    assert [e.step for e in cb.monitor.events if e.kind == NONFINITE_GRAD] == [NAN_BATCH // 2]
    assert same(rec.before[2], rec.after[3])  # the whole accumulated step was skipped
    assert not same(rec.before[4], rec.after[5])


def test_detach_at_fit_end_leaves_no_hooks(tmp_path):
    cb = SFMonitorCallback(run_dir=tmp_path, config=QUIET)
    seen = {}

    class Peek(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen["hooks"] = len(monitor_hooks(trainer.optimizers[0]))

    model = Tiny()
    t = trainer([cb, Peek()])
    t.fit(model, loader())
    assert seen["hooks"] == 2  # attached during training: the step pre- and post-hook
    assert monitor_hooks(t.optimizers[0]) == []
    assert cb.monitor.model is None and cb.monitor.optimizer is None
    # fit again with the same callback: it attaches again and keeps counting
    t2 = trainer([cb])
    t2.fit(model, loader())
    assert cb.monitor.step == 2 * N_BATCHES
    assert monitor_hooks(t2.optimizers[0]) == []


def test_detach_on_exception(tmp_path):
    cb = SFMonitorCallback(run_dir=tmp_path, config=QUIET)
    t = trainer([cb])
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(Tiny(fail_at=2), loader())
    assert cb.monitor.model is None
    assert monitor_hooks(t.optimizers[0]) == []
    assert cb.monitor.step == 2


def test_plateau_sets_trainer_should_stop(tmp_path):
    early_stopping = {"rungs": [{"after": 1, "actions": ["lr_drop"]}, {"after": 2, "actions": ["stop"]}]}
    cfg = {
        **QUIET,
        "detectors": {"plateau": {"patience": 1, "grace": 1}},
        "policy": {"ladders": {"plateau": early_stopping}},
    }
    cb = SFMonitorCallback(run_dir=tmp_path, config=cfg)
    t = trainer([cb], max_epochs=10, val=True)
    t.fit(Tiny(val_losses=[1.0] * 10), loader(2), loader(1))
    plateaus = [e for e in cb.monitor.events if e.kind == PLATEAU]
    assert len(plateaus) == 2 and STOP in plateaus[-1].actions
    assert cb.monitor.should_stop
    assert t.current_epoch == 3  # epochs 0, 1, 2 validated; stopped after the third
    assert cb.stop_reason is None  # plateau is a graceful stop, not StopTraining


def test_eval_metric_mapping(tmp_path):
    early_stopping = {"rungs": [{"after": 1, "actions": ["lr_drop"]}, {"after": 2, "actions": ["stop"]}]}
    cfg = {
        **QUIET,
        "detectors": {"plateau": {"metric": "my_loss", "patience": 1, "grace": 1}},
        "policy": {"ladders": {"plateau": early_stopping}},
    }
    cb = SFMonitorCallback(run_dir=tmp_path, config=cfg, eval_metrics={"val_loss": "my_loss"})
    t = trainer([cb], max_epochs=10, val=True)
    t.fit(Tiny(val_losses=[3.0, 2.0, 1.0, 1.0, 1.0, 1.0]), loader(2), loader(1))
    assert t.current_epoch == 5  # improved twice, then stalled twice
    assert [e.data["metric"] for e in cb.monitor.events if e.kind == PLATEAU] == ["my_loss"] * 2
    with pytest.raises(ConfigError, match="eval_metrics"):
        SFMonitorCallback(eval_metrics=["val_loss"])


def test_stop_training_becomes_a_graceful_stop(tmp_path):
    cfg = {**QUIET, "policy": {"ladders": {"nonfinite_grad": {"rungs": [{"after": 1, "actions": ["stop"]}]}}}}
    cb = SFMonitorCallback(run_dir=tmp_path, config=cfg)
    rec = Recorder()
    t = trainer([cb, rec], max_epochs=3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t.fit(Tiny(nan_batch=NAN_BATCH), loader())
    assert cb.stop_reason and "stopped training at step 3" in cb.stop_reason
    assert any("stopped training" in str(x.message) for x in w)
    assert same(rec.before[NAN_BATCH], rec.after[NAN_BATCH])  # the NaN step did not land
    assert max(rec.after) == NAN_BATCH and t.global_step == NAN_BATCH + 1  # stopped at once
    assert cb.monitor.model is None


def test_bad_monitor_kwargs_fail_at_construction():
    with pytest.raises(ConfigError):
        SFMonitorCallback(config={"no_such_key": 1})


def test_import_sfmonitor_does_not_import_lightning():
    import subprocess

    code = (
        "import sys, sfmonitor, sfmonitor.integrations; "
        "assert 'lightning' not in sys.modules and 'pytorch_lightning' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fp16_with_grad_scaler(tmp_path):
    """'16-mixed' with a GradScaler (a CPU one here; on GPU Lightning makes it): the pipeline runs in
    the monitor's scaler.step wrapper, sees the scaler's own overflow skips, and skips the NaN step."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    cb = SFMonitorCallback(run_dir=tmp_path, config=QUIET)
    rec = Recorder()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    t = trainer([cb, rec], precision=None, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    t.fit(Tiny(nan_batch=NAN_BATCH, combine=cb), loader())
    assert cb.monitor.step == N_BATCHES
    nan = [e for e in cb.monitor.events if e.kind == NONFINITE_LOSS]
    assert [e.step for e in nan] == [NAN_BATCH] and SKIP_STEP in nan[0].actions
    assert same(rec.before[NAN_BATCH], rec.after[NAN_BATCH])
    # every other step either landed or was one of the scaler's own overflow skips, recorded as such
    scaler_skips = {e.step for e in cb.monitor.events if e.data.get("skipped_by") == "grad_scaler"}
    for i in range(N_BATCHES):
        if i != NAN_BATCH:
            assert same(rec.before[i], rec.after[i]) == (i in scaler_skips), i
    assert cb.monitor.stats["amp/skipped_steps"] == len(scaler_skips) + 1
    assert "step" not in scaler.__dict__ and monitor_hooks(t.optimizers[0]) == []  # detached


def test_missing_lightning_gives_the_install_hint():
    import subprocess

    code = (
        "import sys; sys.modules['lightning'] = sys.modules['lightning.pytorch'] = None\n"
        "try:\n    import sfmonitor.integrations.lightning\nexcept ImportError as e:\n"
        "    assert \"pip install 'sfmonitor[lightning]'\" in str(e), e\nelse:\n    raise SystemExit('no error')"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
