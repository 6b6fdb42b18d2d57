"""State an optimizer keeps in its param groups, not per parameter: a skip and an undo put it back.

Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"; the ``schedulefree``
package) keeps its step count ``k``, the averaging's ``weight_sum`` and ``lr_max`` in each param
group, and advances them in every ``step()``, with or without gradients. A skip (gradients hidden)
left ``k`` and ``weight_sum`` one step ahead of the run that never saw the batch; an undo of an
update at 1e4x the LR put back the weights and ``z`` but left ``lr_max`` at the faulty LR for the
rest of the run, which reweighted its averaging from then on (a probe: held-out loss 1.25-1.54x the
twin's 10 steps later)."""

from __future__ import annotations

import copy

import pytest
import torch
from _state import quiet
from torch import nn

import sfmonitor
from sfmonitor.checkpoint import capture_state, restore_state


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """AdamW, schedule-free (the reference implementation's single-tensor path): the parameters
    hold y, the state z; ``eval()`` / ``train()`` move the parameters to x and back."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=5):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps, r=0.0,
            weight_lr_power=2.0, k=0, weight_sum=0.0, lr_max=-1.0, train_mode=True,
        )  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def _move(self, to_train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] != to_train:
                beta1 = group["betas"][0]
                for p in group["params"]:
                    if "z" in self.state[p]:
                        p.lerp_(self.state[p]["z"], 1 - beta1 if to_train else 1 - 1 / beta1)
                group["train_mode"] = to_train

    def eval(self) -> None:
        self._move(False)

    def train(self) -> None:
        self._move(True)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            k, (beta1, beta2) = group["k"], group["betas"]
            lr = group["lr"] * min(1.0, (k + 1) / group["warmup_steps"])
            lr_max = group["lr_max"] = max(lr, group["lr_max"])
            weight = (k + 1) ** group["r"] * lr_max ** group["weight_lr_power"]
            group["weight_sum"] += weight
            ckp1 = weight / group["weight_sum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "z" not in state:
                    state["z"], state["exp_avg_sq"] = p.clone(), torch.zeros_like(p)
                z, v = state["z"], state["exp_avg_sq"]
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                g = p.grad / (v / (1 - beta2 ** (k + 1))).sqrt().add_(group["eps"])
                g.add_(p, alpha=group["weight_decay"])
                p.lerp_(z, ckp1)
                p.add_(g, alpha=lr * (beta1 * (1 - ckp1) - 1))
                z.sub_(g, alpha=lr)
            group["k"] = k + 1


def batches(n=40):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def run(tmp_path, monitored, *, nan_at=None, lr_fault_at=None, drop=()):
    """Schedule-free AdamW on an MLP, an evaluation (x) every 10 steps; the final state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = ScheduleFreeAdamW(model.parameters())
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet()) if monitored else None
    held_out = batches(1)[0]
    for i, (x, y) in enumerate(batches()):
        if i in drop:
            continue
        if i == nan_at:
            x = x.clone()
            x[3, 2] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        (mon.combine(loss) if mon else loss).backward()
        opt.param_groups[0]["lr"] = 0.01 * (1e4 if i == lr_fault_at else 1)
        opt.step()
        opt.zero_grad()
        if i % 10 == 9:
            opt.eval()
            with torch.no_grad():
                nn.functional.mse_loss(model(held_out[0]), held_out[1])
            opt.train()
    if mon is not None:
        mon.detach()
    return model, opt, mon


def same(a, b):
    (ma, oa, _), (mb, ob, _) = a, b
    sa, sb = oa.state_dict(), ob.state_dict()
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in sa["param_groups"]]
    twins = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in sb["param_groups"]]
    return (
        all(torch.equal(x, y) for x, y in zip(ma.parameters(), mb.parameters()))
        and groups == twins
        and all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
    )


def test_a_healthy_schedule_free_run_is_untouched(tmp_path):
    bare, monitored = run(tmp_path, False), run(tmp_path, True)
    assert monitored[2].events == []
    assert same(monitored, bare)


def test_a_skipped_batch_leaves_the_optimizers_group_counters_as_the_run_without_it(tmp_path):
    """The skip hides the gradients; the optimizer's step still advanced ``k`` and
    ``weight_sum``: they are put back as the step found them."""
    model, opt, mon = monitored = run(tmp_path, True, nan_at=17)
    assert [(e.step, e.actions) for e in mon.events] == [(17, ["skip_step"])]
    twin = run(tmp_path, False, drop=(17,))
    assert opt.param_groups[0]["k"] == twin[1].param_groups[0]["k"] == 39
    assert same(monitored, twin)


def test_an_undone_update_puts_back_the_optimizers_group_counters(tmp_path):
    """An update at 1e4x the LR, undone at the next step: ``lr_max`` (the averaging's weight
    from then on) and ``k`` go back with the weights and ``z``; the run goes on as the one without
    those two batches, bit for bit."""
    model, opt, mon = monitored = run(tmp_path, True, lr_fault_at=20)
    assert [e.data["step"] for e in mon.events if "undo" in e.actions] == [20], [
        (e.step, e.kind, e.actions) for e in mon.events
    ]
    twin = run(tmp_path, False, drop=(20, 21))
    assert opt.param_groups[0]["lr_max"] == pytest.approx(0.01)
    assert same(monitored, twin)


def test_a_rollback_puts_back_the_group_entries_the_optimizers_step_writes_and_keeps_the_users():
    """``restore_state(step_keys=...)``: the snapshot's values of the keys the optimizer's step
    writes (its own counters), the live values of the others (the user's LR schedule)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = ScheduleFreeAdamW(model.parameters())
    step = lambda: (model(torch.randn(4, 3)).pow(2).mean().backward(), opt.step(), opt.zero_grad())
    step()
    state = copy.deepcopy(capture_state(model, opt, rng=False))
    held = {k: opt.param_groups[0][k] for k in ("k", "weight_sum", "lr_max")}
    step()
    opt.param_groups[0]["lr"] = 0.5  # the user's schedule, between the steps
    step()
    restore_state(state, model, opt, rng=False, step_keys={(0, "k"), (0, "weight_sum"), (0, "lr_max")})
    assert {k: opt.param_groups[0][k] for k in held} == held
    assert opt.param_groups[0]["lr"] == 0.5


def test_a_rollback_puts_back_the_optimizers_group_counters_with_the_weights(tmp_path):
    """A rollback (here the ladder's answer to a NaN batch) puts the snapshot's step count back
    with its weights: after it, ``k`` counts the updates the weights hold."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = ScheduleFreeAdamW(model.parameters())
    cfg = quiet(
        actions={"rollback": {"snapshot_every": 5, "skip_batches": 0}},
        policy={"ladders": {"bad_batch": {"rungs": [{"after": 1, "actions": ["rollback"]}]}}},
    )
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=cfg)
    ks = []
    for i, (x, y) in enumerate(batches(20)):
        if i == 17:
            x = x.clone()
            x[3, 2] = float("nan")
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        ks.append(opt.param_groups[0]["k"])
    mon.detach()
    (rolled,) = [e for e in mon.events if "rollback" in e.actions]
    back_to = rolled.data["action_results"]["rollback"]["restored_from"]
    assert rolled.step == 17 and back_to < 17
    assert ks[17] == back_to  # (was 18: the step count of the state rolled back from)
