"""Run by tests/test_distributed_integrations.py under torchrun (2 CPU ranks, gloo): a Lightning
Trainer with strategy="ddp" and the SFMonitorCallback. Rank 1 alone sees a NaN batch; each rank
logs its own validation accuracy (no sync_dist). Each rank saves what it saw to OUT/rank<r>.pt.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_dist_lightning.py OUT
"""

import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn

from sfmonitor.integrations.lightning import SFMonitorCallback

NAN_BATCH = 2
ACCURACY = {0: [0.9, 0.5, 0.2], 1: [0.9, 0.0, 0.0]}  # per rank, per validation (chance 0.1)


class Tiny(pl.LightningModule):
    def __init__(self, cb):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.cb = cb

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if batch_idx == NAN_BATCH and self.global_rank == 1 and self.current_epoch == 0:
            loss = loss * torch.tensor(float("nan"))
        return self.cb.monitor.combine(loss)

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", ACCURACY[self.global_rank][self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(out: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    # The accuracies are scripted and the training stays healthy: the report's rule alone decides
    # the collapse (train_loss_rise 0), so that its rollback is taken on both ranks alike.
    cfg = {"console": False, "detectors": {"accuracy_collapse": {"train_loss_rise": 0}}}
    cb = SFMonitorCallback(chance=0.1, run_dir=os.path.join(out, "run"), sinks=[], config=cfg)
    model = Tiny(cb)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=3,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loaders = [torch.utils.data.DataLoader(data, batch_size=4) for _ in range(2)]
    trainer.fit(model, *loaders)
    rank = trainer.global_rank
    torch.save(
        {
            "rank": rank,
            "world": trainer.world_size,
            "events": [
                (e.step, e.kind, list(e.actions), e.data.get("ranks"), e.data.get("value")) for e in cb.monitor.events
            ],
            "params": [p.detach().clone() for p in model.parameters()],
            "steps": cb.monitor.step,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1])
    if torch.distributed.is_initialized():
        # The results are saved: end without the interpreter's teardown, where gloo's threads
        # abort the process now and then (SIGABRT; see _integration_helpers.leave_process_group).
        from _integration_helpers import leave_process_group

        leave_process_group()
