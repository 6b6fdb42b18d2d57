"""Policy: maps findings to decisions (actions with their cause), with escalation, cooldowns and a
rescue budget. Stateless about the model: it only counts.

Escalation. Each event kind has a ladder of rungs; a rung is reached when the current *streak* of
that kind holds at least ``after`` occurrences. Occurrences at most ``window`` steps apart belong to
one streak (``window = 1``: consecutive steps, "3 in a row"; ``0``: any distance); several findings
of one kind in one step are one occurrence. A finding with ``occurrence`` set (the plateau
detector, whose findings are validations apart) sets the streak itself; an ``urgent`` finding
(trouble already here) goes at least to the first rung that acts.

Cooldowns. An action taken at step s is not taken again before step s + cooldown (in optimizer
steps), except for a finding about an update made after step s (an update made at the LR the drop
lowered, still too large: the drop did not suffice); suppressed actions are listed in
``Policy.suppressed`` after each ``decide``.

Budget. Every step in which a budgeted action (registered with ``budgeted=True``: rollback,
lr_drop, precision_fallback) is decided spends one rescue. Once ``budget`` rescues are spent, those
actions are replaced by ``on_budget_spent`` (default: checkpoint, stop).

Defaults come from the registry: each kind's ladder from ``registry.KINDS`` (registered beside the
component that reports it), each action's cooldown and order from ``registry.ACTIONS``. The table of
defaults is in docs/policy.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .events import CHECKPOINT, STOP, Decision, Finding
from .registry import ACTIONS, KINDS, action_order, require_action, require_kind
from .schema import Section, option

__all__ = [
    "Ladder",
    "Policy",
    "PolicyConfig",
    "Rung",
    "budgeted_actions",
    "default_cooldowns",
    "default_ladders",
]


@dataclass
class Rung(Section):
    """One rung of a ladder."""

    after: int = option(1, "reached when the streak holds at least this many occurrences", lo=1)
    actions: list[str] = option([], "action names taken at this rung (empty: record the event only)")

    def validate(self) -> None:
        for i, name in enumerate(self.actions):
            require_action(name, f"{self._prefix}actions[{i}]")


@dataclass
class Ladder(Section):
    """The escalation ladder of one event kind."""

    rungs: list[Rung] = option([], "rungs with increasing 'after'")
    window: int = option(
        0, "occurrences at most this many steps apart form one streak (1: consecutive steps; 0: any distance)", lo=0
    )

    def validate(self) -> None:
        for i, rung in enumerate(self.rungs):
            if i and rung.after <= self.rungs[i - 1].after:
                raise ConfigError(
                    f"{self._prefix}rungs[{i}].after: {rung.after} must be greater than "
                    f"the previous rung's ({self.rungs[i - 1].after})"
                )


def default_ladders() -> dict[str, Ladder]:
    """Every registered kind's default ladder."""
    return {
        name: Ladder(rungs=[Rung(after=a, actions=list(acts)) for a, acts in spec.rungs], window=spec.window)
        for name, spec in KINDS.items()
    }


def default_cooldowns() -> dict[str, int]:
    """Every registered action's default cooldown."""
    return {name: spec.cooldown for name, spec in ACTIONS.items()}


def budgeted_actions() -> list[str]:
    """The registered actions that spend the rescue budget."""
    return [name for name, spec in ACTIONS.items() if spec.budgeted]


@dataclass
class PolicyConfig(Section):
    """Ladders, cooldowns and the rescue budget. Kinds and actions you leave out keep their default."""

    ladders: dict[str, Ladder] = field(
        default_factory=default_ladders,
        metadata={"doc": "event kind -> ladder (a kind you give replaces that kind's default ladder)"},
    )
    cooldowns: dict[str, int] = field(
        default_factory=default_cooldowns, metadata={"doc": "action -> steps before it may be taken again"}
    )
    budget: int = option(10, "rescues allowed per run before stopping", lo=0)
    budget_actions: list[str] = field(
        default_factory=budgeted_actions,
        metadata={"doc": "actions that spend the budget (at most one rescue per step)"},
    )
    on_budget_spent: list[str] = option([CHECKPOINT, STOP], "what replaces budgeted actions once the budget is spent")

    def validate(self) -> None:
        p = self._prefix
        for kind in self.ladders:
            require_kind(kind, f"{p}ladders.{kind}")
        for kind, ladder in default_ladders().items():
            self.ladders.setdefault(kind, ladder)
        for name, cd in self.cooldowns.items():
            require_action(name, f"{p}cooldowns.{name}")
            if cd < 0:
                raise ConfigError(f"{p}cooldowns.{name}: {cd} is out of range; allowed: [0, inf]")
        for name, cd in default_cooldowns().items():
            self.cooldowns.setdefault(name, cd)
        for field_name in ("budget_actions", "on_budget_spent"):
            for i, name in enumerate(getattr(self, field_name)):
                require_action(name, f"{p}{field_name}[{i}]")

    def ladder(self, kind: str) -> Ladder | None:
        """The kind's ladder; a kind registered after this config was built gets its default."""
        if kind not in self.ladders and kind in KINDS:
            self.ladders[kind] = default_ladders()[kind]
        return self.ladders.get(kind)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists all the way down (Section.to_dict keeps Sections nested in a
        dict as objects)."""
        out = super().to_dict()
        out["ladders"] = {
            k: {"rungs": [r.to_dict() for r in v.rungs], "window": v.window} for k, v in self.ladders.items()
        }
        return out


class Policy:
    """``decide(step, findings) -> list[Decision]`` in the registered action order;
    ``state_dict`` round-trips."""

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self.streaks: dict[str, list[int]] = {}  # kind -> [last step, count]
        self.last_taken: dict[str, int] = {}  # action -> step it was last taken
        self.rescues_used = 0
        self.spent_at: int | None = None  # the step whose decisions spent the last rescue
        self.suppressed: list[dict[str, Any]] = []  # from the last decide(): actions held back, and why

    def _streak(self, step: int, kind: str, findings: list[Finding], ladder: Ladder) -> int:
        given = [f.occurrence for f in findings if f.occurrence is not None]
        last = self.streaks.get(kind)
        if given:
            count = max(given)
        elif last is not None and last[0] == step:
            count = last[1]
        else:
            near = last is not None and (ladder.window == 0 or step - last[0] <= ladder.window)
            count = last[1] + 1 if last is not None and near else 1
        if any(f.urgent for f in findings):
            acting = next((r.after for r in ladder.rungs if r.actions), None)
            if acting is not None:
                count = max(count, acting)
        self.streaks[kind] = [step, count]
        return count

    @staticmethod
    def _rung(ladder: Ladder, count: int) -> Rung | None:
        reached = [r for r in ladder.rungs if r.after <= count]
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
            ladder = cfg.ladder(kind)
            if ladder is None:
                continue
            count = self._streak(step, kind, group, ladder)
            rung = self._rung(ladder, count)
            if rung is None:
                continue
            for action in rung.actions:
                causes = group if ACTIONS[action].per_finding else group[:1]
                for cause in causes:
                    wanted.append(
                        Decision(
                            action=action, cause=cause, params={"kind": kind, "rung_after": rung.after, "streak": count}
                        )
                    )
        # One decision per action per step; per-finding actions once per component pair (the
        # loss-ratio and the gradient-ratio findings of one pair reweight it once). First cause wins.
        seen: set[tuple[str, Any]] = set()
        unique: list[Decision] = []
        for d in wanted:
            key = (d.action, (d.cause.where or id(d.cause)) if ACTIONS[d.action].per_finding else 0)
            if key not in seen:
                seen.add(key)
                unique.append(d)
        # Cooldowns.
        allowed: list[Decision] = []
        for d in unique:
            cd = cfg.cooldowns.get(d.action, 0)
            last = self.last_taken.get(d.action)
            # A finding about an update made after the action was last taken is new evidence: the
            # action did not suffice (an update at the lowered LR still too large), so no cooldown.
            fresh = d.cause.step is not None and last is not None and d.cause.step > last
            if cd and last is not None and step - last < cd and not fresh:
                self.suppressed.append(
                    {"action": d.action, "kind": d.cause.kind, "reason": f"cooldown: taken at step {last}, {cd} steps"}
                )
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
                        allowed.append(
                            Decision(
                                action=name,
                                cause=cause,
                                params={
                                    "kind": cause.kind,
                                    "budget": cfg.budget,
                                    "rescues_used": self.rescues_used,
                                    "reason": f"rescue budget of {cfg.budget} spent",
                                },
                            )
                        )
                for d in budgeted:
                    self.suppressed.append(
                        {"action": d.action, "kind": d.cause.kind, "reason": f"rescue budget of {cfg.budget} spent"}
                    )
            else:
                self.rescues_used += 1
                self.spent_at = step
        for d in allowed:
            self.last_taken[d.action] = step
        order = action_order()
        allowed.sort(key=lambda d: order.index(d.action))
        return allowed

    def credit(self) -> bool:
        """Give one rescue back: the LR drop it paid for is back on the user's schedule (its
        climb done, or released), the incident over. The budget counts trouble that stays, not
        transients the run recovered from (a schedule bug every few hundred steps stopped a 6000-step
        run that ended at its twin's loss). Returns whether there was one to give back."""
        if self.rescues_used <= 0:
            return False
        self.rescues_used -= 1
        return True

    def refund(self, step: int) -> bool:
        """Give back the rescue the decisions of ``step`` spent when none of their budgeted actions
        changed anything (a precision fallback on a module already in fp32, a rollback without a
        snapshot): the budget counts only rescues that did something. Returns whether it did."""
        if self.spent_at != step:
            return False
        self.rescues_used -= 1
        self.spent_at = None
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "streaks": {k: list(v) for k, v in self.streaks.items()},
            "last_taken": dict(self.last_taken),
            "rescues_used": self.rescues_used,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streaks = {k: [int(v[0]), int(v[1])] for k, v in state.get("streaks", {}).items()}
        self.last_taken = {k: int(v) for k, v in state.get("last_taken", {}).items()}
        self.rescues_used = int(state.get("rescues_used", 0))
