"""Policy: maps findings to decisions (actions with their cause), with escalation, cooldowns and a
rescue budget. Stateless about the model: it only counts.

Escalation. Each event kind has a ladder of rungs; a rung is reached when the current *streak* of
that kind holds at least ``after`` occurrences. Occurrences at most ``window`` steps apart belong to
one streak (``window = 1``: consecutive steps, "3 in a row"; ``0``: any distance); several findings
of one kind in one step are one occurrence. A finding whose ``data`` holds ``"occurrence"`` (the
plateau detector, whose findings are validations apart) sets the streak itself.

Cooldowns. An action taken at step s is not taken again before step s + cooldown (in optimizer
steps); suppressed actions are listed in ``Policy.suppressed`` after each ``decide``.

Budget. Every step in which a budgeted action (default: rollback, lr_drop, precision_fallback) is
decided spends one rescue. Once ``budget`` rescues are spent, those actions are replaced by
``on_budget_spent`` (default: checkpoint, stop).

Defaults (see docs/policy.md for the table and the sources):

| kind | ladder |
|---|---|
| nonfinite_loss, nonfinite_grad | 1: skip_step; 3 in a row: skip_step + rollback + lr_drop |
| nonfinite_param | 1: rollback + lr_drop |
| grad_spike | 1: clip |
| loss_spike | 1: rollback; 2nd within 50 steps: rollback + lr_drop |
| update_ratio_spike | 1: rollback + lr_drop |
| loss_ratio_imbalance, grad_ratio_imbalance | 1: reweight |
| loss_scale_floor | 1: nothing (event only) |
| activation_overflow | 1: nothing (warning); 2nd within 100 steps: precision_fallback |
| accuracy_collapse | 1: rollback + lr_drop |
| plateau | 1: lr_drop; 2: stop |
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .schema import Section, option
from .events import (ACCURACY_COLLAPSE, ACTION_NAMES, ACTIVATION_OVERFLOW, CHECKPOINT, CLIP,
                     EVENT_KINDS, GRAD_NOISE, GRAD_RATIO_IMBALANCE, GRAD_SPIKE, LOSS_RATIO_IMBALANCE,
                     LOSS_SCALE_FLOOR, LOSS_SPIKE, LR_DROP, NONFINITE_GRAD, NONFINITE_LOSS,
                     NONFINITE_PARAM, PLATEAU, PRECISION_FALLBACK, REWEIGHT, ROLLBACK, SKIP_STEP,
                     STOP, UPDATE_RATIO_SPIKE, ConfigError, Decision, Finding)

__all__ = ["Rung", "Ladder", "PolicyConfig", "Policy", "ACTION_ORDER", "PER_FINDING_ACTIONS",
           "DEFAULT_LADDERS", "DEFAULT_COOLDOWNS"]

# Order in which one step's decisions are carried out: save the good state first, keep the bad
# update from landing, go back, then change the settings that apply from now on; stop comes last.
ACTION_ORDER = (CHECKPOINT, SKIP_STEP, ROLLBACK, LR_DROP, PRECISION_FALLBACK, REWEIGHT, CLIP,
                GRAD_NOISE, STOP)
# Actions decided once per finding (each imbalanced pair is reweighted); the others once per step.
PER_FINDING_ACTIONS = (REWEIGHT,)
OCCURRENCE = "occurrence"  # Finding.data key a detector may set to place itself on the ladder


@dataclass
class Rung(Section):
    """One rung of a ladder."""

    after: int = option(1, "reached when the streak holds at least this many occurrences", lo=1)
    actions: list[str] = option([], "action names taken at this rung (empty: record the event only)")

    def validate(self) -> None:
        for i, name in enumerate(self.actions):
            if name not in ACTION_NAMES:
                raise ConfigError(f"{self._prefix}actions[{i}]: unknown action {name!r}; "
                                  f"allowed: {', '.join(ACTION_NAMES)}")


@dataclass
class Ladder(Section):
    """The escalation ladder of one event kind."""

    rungs: list[Rung] = option([], "rungs with increasing 'after'")
    window: int = option(0, "occurrences at most this many steps apart form one streak (1: consecutive "
                            "steps; 0: any distance)", lo=0)

    def validate(self) -> None:
        for i, rung in enumerate(self.rungs):
            if i and rung.after <= self.rungs[i - 1].after:
                raise ConfigError(f"{self._prefix}rungs[{i}].after: {rung.after} must be greater than "
                                  f"the previous rung's ({self.rungs[i - 1].after})")


def _ladder(window: int, *rungs: tuple[int, list[str]]) -> Ladder:
    return Ladder(rungs=[Rung(after=a, actions=list(acts)) for a, acts in rungs], window=window)


_NONFINITE = _ladder(1, (1, [SKIP_STEP]), (3, [SKIP_STEP, ROLLBACK, LR_DROP]))  # issue 4: "3 in a row: LR drop + rollback"
DEFAULT_LADDERS: dict[str, Ladder] = {
    NONFINITE_LOSS: _NONFINITE,
    NONFINITE_GRAD: copy.deepcopy(_NONFINITE),
    NONFINITE_PARAM: _ladder(0, (1, [ROLLBACK, LR_DROP])),  # the update landed: only going back helps
    GRAD_SPIKE: _ladder(0, (1, [CLIP])),
    # DESIGN: a loss jump on the next step means the update that landed was bad: go back to the
    # last good snapshot (rollback also keeps this step's update out); again within 50: drop LR.
    LOSS_SPIKE: _ladder(50, (1, [ROLLBACK]), (2, [ROLLBACK, LR_DROP])),
    UPDATE_RATIO_SPIKE: _ladder(0, (1, [ROLLBACK, LR_DROP])),  # DESIGN: a landed spike is rolled back
    LOSS_RATIO_IMBALANCE: _ladder(0, (1, [REWEIGHT])),  # the report's dynamic reweighting
    GRAD_RATIO_IMBALANCE: _ladder(0, (1, [REWEIGHT])),
    LOSS_SCALE_FLOOR: _ladder(0, (1, [])),
    # A first warning (|x| >= half the dtype's max) is told; a second within 100 steps means the
    # module keeps living near the limit: run it in fp32 before it overflows (proving ground: the
    # trap's fusion logits grow with the image features; fp32 fusion attention is what holds).
    ACTIVATION_OVERFLOW: _ladder(100, (1, []), (2, [PRECISION_FALLBACK])),
    ACCURACY_COLLAPSE: _ladder(0, (1, [ROLLBACK, LR_DROP])),
    PLATEAU: _ladder(0, (1, [LR_DROP]), (2, [STOP])),  # the report's improved early stopping
}

DEFAULT_COOLDOWNS: dict[str, int] = {
    SKIP_STEP: 0, CLIP: 0, REWEIGHT: 0, GRAD_NOISE: 0, STOP: 0, PRECISION_FALLBACK: 0,
    ROLLBACK: 20,      # our choice: let a restored run take a few steps before going back again
    LR_DROP: 20,       # our choice: one drop per rollback, not one per finding of a burst
    CHECKPOINT: 100,   # our choice: emergency checkpoints are big; one per incident
}


@dataclass
class PolicyConfig(Section):
    """Ladders, cooldowns and the rescue budget. Kinds and actions you leave out keep their default."""

    ladders: dict[str, Ladder] = option(DEFAULT_LADDERS, "event kind -> ladder (a kind you give "
                                                         "replaces that kind's default ladder)")
    cooldowns: dict[str, int] = option(DEFAULT_COOLDOWNS, "action -> steps before it may be taken again")
    budget: int = option(10, "rescues allowed per run before stopping (our choice)", lo=0)
    budget_actions: list[str] = option([ROLLBACK, LR_DROP, PRECISION_FALLBACK],
                                       "actions that spend the budget (at most one rescue per step)")
    on_budget_spent: list[str] = option([CHECKPOINT, STOP], "what replaces budgeted actions once "
                                                            "the budget is spent")

    def validate(self) -> None:
        p = self._prefix
        for kind in self.ladders:
            if kind not in EVENT_KINDS:
                raise ConfigError(f"{p}ladders.{kind}: unknown event kind; allowed: {', '.join(EVENT_KINDS)}")
        for kind, ladder in DEFAULT_LADDERS.items():
            self.ladders.setdefault(kind, copy.deepcopy(ladder))
        for name, cd in self.cooldowns.items():
            if name not in ACTION_NAMES:
                raise ConfigError(f"{p}cooldowns.{name}: unknown action; allowed: {', '.join(ACTION_NAMES)}")
            if cd < 0:
                raise ConfigError(f"{p}cooldowns.{name}: {cd} is out of range; allowed: [0, inf]")
        for name, cd in DEFAULT_COOLDOWNS.items():
            self.cooldowns.setdefault(name, cd)
        for field_name in ("budget_actions", "on_budget_spent"):
            for i, name in enumerate(getattr(self, field_name)):
                if name not in ACTION_NAMES:
                    raise ConfigError(f"{p}{field_name}[{i}]: unknown action {name!r}; "
                                      f"allowed: {', '.join(ACTION_NAMES)}")


    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists all the way down (config.Section.to_dict keeps Sections nested in
        a dict as objects)."""
        out = super().to_dict()
        out["ladders"] = {k: {"rungs": [r.to_dict() for r in v.rungs], "window": v.window}
                          for k, v in self.ladders.items()}
        return out


class Policy:
    """``decide(step, findings) -> list[Decision]`` in ``ACTION_ORDER``; ``state_dict`` round-trips."""

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self.streaks: dict[str, list[int]] = {}    # kind -> [last step, count]
        self.last_taken: dict[str, int] = {}       # action -> step it was last taken
        self.rescues_used = 0
        self.suppressed: list[dict[str, Any]] = []  # from the last decide(): actions held back, and why

    def _streak(self, step: int, kind: str, findings: list[Finding]) -> int:
        given = [f.data.get(OCCURRENCE) for f in findings if isinstance(f.data.get(OCCURRENCE), int)]
        last = self.streaks.get(kind)
        if given:
            count = max(given)
        elif last is not None and last[0] == step:
            count = last[1]
        else:
            window = self.config.ladders[kind].window
            near = last is not None and (window == 0 or step - last[0] <= window)
            count = last[1] + 1 if near else 1
        self.streaks[kind] = [step, count]
        return count

    def _rung(self, kind: str, count: int) -> Rung | None:
        reached = [r for r in self.config.ladders[kind].rungs if r.after <= count]
        return reached[-1] if reached else None

    def decide(self, step: int, findings: Iterable[Finding]) -> list[Decision]:
        """Decisions for the findings of optimizer step ``step`` (empty when there are none)."""
        cfg = self.config
        self.suppressed = []
        by_kind: dict[str, list[Finding]] = {}
        for f in findings:
            by_kind.setdefault(f.kind, []).append(f)
        wanted: list[Decision] = []
        for kind, group in by_kind.items():
            if kind not in cfg.ladders:
                continue
            count = self._streak(step, kind, group)
            rung = self._rung(kind, count)
            if rung is None:
                continue
            for action in rung.actions:
                causes = group if action in PER_FINDING_ACTIONS else group[:1]
                for cause in causes:
                    wanted.append(Decision(action=action, cause=cause,
                                           params={"kind": kind, "rung_after": rung.after, "streak": count}))
        # One decision per action per step; per-finding actions once per component pair (the
        # loss-ratio and the gradient-ratio findings of one pair reweight it once). First cause wins.
        seen: set[tuple[str, Any]] = set()
        unique: list[Decision] = []
        for d in wanted:
            pair = (d.cause.data.get("a"), d.cause.data.get("b"))
            key = (d.action, (pair if pair != (None, None) else id(d.cause))
                   if d.action in PER_FINDING_ACTIONS else 0)
            if key not in seen:
                seen.add(key)
                unique.append(d)
        # Cooldowns.
        allowed: list[Decision] = []
        for d in unique:
            cd = cfg.cooldowns.get(d.action, 0)
            last = self.last_taken.get(d.action)
            if cd and last is not None and step - last < cd:
                self.suppressed.append({"action": d.action, "kind": d.cause.kind,
                                        "reason": f"cooldown: taken at step {last}, {cd} steps"})
                continue
            allowed.append(d)
        # Budget.
        budgeted = [d for d in allowed if d.action in cfg.budget_actions]
        if budgeted:
            if self.rescues_used >= cfg.budget:
                cause = budgeted[0].cause
                allowed = [d for d in allowed if d.action not in cfg.budget_actions]
                have = {d.action for d in allowed}
                for name in cfg.on_budget_spent:
                    if name not in have:
                        allowed.append(Decision(action=name, cause=cause, params={
                            "kind": cause.kind, "budget": cfg.budget, "rescues_used": self.rescues_used,
                            "reason": f"rescue budget of {cfg.budget} spent"}))
                for d in budgeted:
                    self.suppressed.append({"action": d.action, "kind": d.cause.kind,
                                            "reason": f"rescue budget of {cfg.budget} spent"})
            else:
                self.rescues_used += 1
        for d in allowed:
            self.last_taken[d.action] = step
        allowed.sort(key=lambda d: ACTION_ORDER.index(d.action))
        return allowed

    def state_dict(self) -> dict[str, Any]:
        return {"streaks": {k: list(v) for k, v in self.streaks.items()},
                "last_taken": dict(self.last_taken), "rescues_used": self.rescues_used}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streaks = {k: [int(v[0]), int(v[1])] for k, v in state.get("streaks", {}).items()}
        self.last_taken = {k: int(v) for k, v in state.get("last_taken", {}).items()}
        self.rescues_used = int(state.get("rescues_used", 0))
