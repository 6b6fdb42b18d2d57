"""Run by tests/test_distributed_integrations.py under torchrun (2 CPU ranks, gloo): a Hugging Face
Trainer (accelerate, DDP) with the SFMonitorTrainerCallback. Rank 1 alone sees a NaN in one
training forward; each rank reports its own evaluation accuracy. Each rank saves what it saw to
OUT/rank<r>.pt.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_dist_transformers.py OUT
"""

import os
import sys

import torch
import transformers
from _integration_helpers import SEQ, VOCAB, Tokens  # tests/ is this script's directory

from sfmonitor.integrations.transformers import SFMonitorTrainerCallback

NAN_FORWARD = 2  # rank 1's third training forward
ACCURACY = {0: [0.9, 0.5, 0.2], 1: [0.9, 0.0, 0.0]}  # per rank, per evaluation (chance 0.1)


class RankAccuracy(transformers.TrainerCallback):
    """Adds this rank's own eval_accuracy to the metrics before the monitor's callback reads them."""

    def __init__(self, rank):
        self.rank, self.n = rank, 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_accuracy"] = ACCURACY[self.rank][self.n]
        self.n += 1


class Combined(transformers.Trainer):
    """Passes the loss through monitor.combine (docs/integrations.md), so the monitor sees each
    rank's own loss, not only the all-reduced gradients, and can name where a NaN started."""

    monitor_cb: SFMonitorTrainerCallback

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if return_outputs:
            return self.monitor_cb.monitor.combine(out[0]), out[1]
        return self.monitor_cb.monitor.combine(out)


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    calls = {"n": 0}

    def nan_on_rank1(module, inputs, output):
        if not module.training:
            return None
        n, calls["n"] = calls["n"], calls["n"] + 1
        return output * float("nan") if (rank == 1 and n == NAN_FORWARD) else None

    model.transformer.wte.register_forward_hook(nan_on_rank1)
    # The accuracies are scripted and the training stays healthy: the report's rule alone decides
    # the collapse (train_loss_rise 0), so that its rollback is taken on both ranks alike.
    cfg = {"console": False, "detectors": {"accuracy_collapse": {"train_loss_rise": 0}}}
    cb = SFMonitorTrainerCallback(chance=0.1, run_dir=os.path.join(out, "run"), sinks=[], config=cfg)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "hf"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # keep the raw gradients (the Trainer clips before the monitor's hook)
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Combined(
        model=model,
        args=args,
        train_dataset=Tokens(48),
        eval_dataset=Tokens(8),
        callbacks=[RankAccuracy(rank), cb],
    )
    trainer.monitor_cb = cb
    trainer.train()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    torch.save(
        {
            "rank": rank,
            "world": world,
            "ddp": type(trainer.model_wrapped).__name__,
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
