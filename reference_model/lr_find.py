"""``sfmonitor lr-find --config trap``: the LR range test on the Superfusion reference model.

Builds the model, data, optimizer and GradScaler of a reference config exactly as the trainer
does, sweeps the LR with ``sfmonitor.tools.lr_find.lr_find`` and prints the curve and its
suggestion. Also ``python -m reference_model.lr_find``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from sfmonitor.tools.lr_find import JSON_FILE, PNG_FILE, lr_find

from ._schema import ConfigError
from .data import BucketedLoader, DataError, build_data
from .model import build_model
from .train import autocast, load_config, make_optimizer, parse_sets

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """LR range test on the reference model"""
    p = argparse.ArgumentParser(
        prog="sfmonitor lr-find",
        description="LR range test on the Superfusion reference model: "
        "sweeps the LR, prints the curve and a suggestion.",
    )
    p.add_argument("--config", default="trap", help="config name in reference_model/configs or a YAML path")
    p.add_argument("--seed", type=int, default=0, help="model init and batch order seed")
    p.add_argument("--num-iter", type=int, default=100, help="optimizer steps of the sweep at most")
    p.add_argument("--start-lr", type=float, default=1e-7)
    p.add_argument("--end-lr", type=float, default=10.0)
    p.add_argument("--mode", default="exp", choices=("exp", "linear"))
    p.add_argument(
        "--diverge-factor",
        type=float,
        default=10.0,
        help="stop when the smoothed loss exceeds this x the best loss (report: 10)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.amp=false (repeatable)",
    )
    p.add_argument("--out", default=None, help="folder for lr_find.json and lr_find.png")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="with --out: JSON only")
    p.add_argument("--rows", type=int, default=20, help="rows of the printed table")
    args = p.parse_args(argv)

    try:
        overrides = parse_sets(args.set)
    except ValueError as e:
        p.error(str(e))
    try:
        cfg = load_config(args.config, overrides)
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        train_set, _, vocab, n_classes = build_data(cfg.data, cfg.model.max_len)
    except (ConfigError, DataError) as e:
        print(f"sfmonitor lr-find: {e}", file=sys.stderr)
        return 2
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)
    model = build_model(dataclasses.replace(cfg.model, vocab_size=vocab, num_classes=n_classes)).to(device)
    opt = make_optimizer(model, tc)
    scaler = torch.amp.GradScaler(device.type, init_scale=tc.init_scale, enabled=tc.amp)
    loader = BucketedLoader(train_set, tc.micro_batch, seed=args.seed)

    def loss_fn(m: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        with autocast(device, tc.amp):
            return m(**{k: v.to(device) for k, v in batch.items()})

    try:
        res = lr_find(
            model,
            opt,
            loader,
            loss_fn,
            start_lr=args.start_lr,
            end_lr=args.end_lr,
            num_iter=args.num_iter,
            mode=args.mode,
            diverge_factor=args.diverge_factor,
            accumulation=tc.accumulation,
            max_grad_norm=tc.max_grad_norm,
            weights=tc.loss_weights,
            scaler=scaler,
            out_dir=args.out,
            plot=args.plot,
        )
    except ValueError as e:  # the sweep's settings (a ConfigError of sfmonitor is a ValueError)
        print(f"sfmonitor lr-find: {e}", file=sys.stderr)
        return 2
    print(
        f"LR range test: config {cfg.name}, seed {args.seed}, {tc.optimizer} "
        f"(config lr {tc.lr:.3e}), {'fp16 + GradScaler' if tc.amp else 'fp32'}, "
        f"{tc.accumulation} micro-batches of {tc.micro_batch} per step, {res.seconds:.1f} s"
    )
    print(res.table(args.rows))
    print()
    print(res.summary())
    if res.cyclic_max_lr is not None:
        print(
            f"train with it:  sfmonitor train --config {args.config} --set train.schedule=cyclic "
            f"--set train.lr={res.cyclic_max_lr:.3g}  (the trainer cycles lr/10 .. lr)"
        )
    if args.out:
        print(f"wrote {os.path.join(args.out, JSON_FILE)}" + (f" and {PNG_FILE}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
