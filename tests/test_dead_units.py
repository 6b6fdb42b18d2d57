"""dead_units: units whose gradients stay exactly zero (dead ReLUs), told, nothing changed."""

from __future__ import annotations

import pytest
import torch
from _state import quiet
from torch import nn

import sfmonitor
from sfmonitor import stats as S
from sfmonitor.detectors import DeadUnits, DeadUnitsConfig


class Net(nn.Module):
    """A ReLU MLP; at step 5 (``kill_units``) ``kill`` of the first hidden layer's 64 units get a
    bias of -100: no input of this data switches them on any more, their gradients are exactly zero
    from then on (the sample at step 0 saw them alive)."""

    def __init__(self, kill: int = 0):
        super().__init__()
        self.kill = kill
        self.inp = nn.Linear(8, 64)
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)

    def kill_units(self):
        with torch.no_grad():
            self.inp.bias[: self.kill] = -100.0

    def forward(self, x):
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def _run(tmp_path, kill, steps=60, monitored=True, config=None):
    config = {"stats": {"dead_units_samples": 5}} if config is None else config
    torch.manual_seed(0)
    model = Net(kill)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = (
        sfmonitor.attach(model, optimizer, run_dir=str(tmp_path), sinks=[], config={**quiet(), **config})
        if monitored
        else None
    )
    seen = []
    for i in range(steps):
        if i == 5:
            model.kill_units()
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        (mon.combine(loss) if mon is not None else loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        if mon is not None:
            seen.append({k: v for k, v in mon.stats.items() if k.startswith("dead_units/")})
    events = list(mon.events) if mon is not None else []
    if mon is not None:
        mon.detach()
    return model, events, seen


def test_a_layer_whose_units_died_is_told_once_naming_its_group_and_training_is_untouched(tmp_path):
    """48 of the first layer's 64 units die at step 5: every sample from step 10 on (each 10 steps)
    finds their gradient rows exactly zero; at the fifth (step 50; stats.dead_units_samples 5) 75%
    of the layer's units are dead. Told once, no action, the run bit-identical to the bare one."""
    model, events, seen = _run(tmp_path / "mon", kill=48)
    bare, _, _ = _run(tmp_path / "bare", kill=48, monitored=False)
    told = [e for e in events if e.kind == "dead_units"]
    assert [(e.step, e.data["share"]) for e in told] == [(50, 0.75)], events
    assert told[0].actions == [] and "group inp" in told[0].message and "LR" in told[0].message
    assert seen[50]["dead_units/inp"] == 0.75 and seen[40]["dead_units/inp"] == 0.0  # 4 samples: not yet
    assert seen[51] == {}  # sampled steps only (stats.dead_units_every: 10)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bare.state_dict().values()))


def test_at_the_defaults_a_unit_is_dead_after_20_samples_10_steps_apart(tmp_path):
    _, events, seen = _run(tmp_path, kill=48, steps=210, config={})
    # (the bias set at step 5 is the loop's change of the weights: a new regime, told)
    assert [(e.step, e.kind) for e in events] == [(5, "new_regime"), (200, "dead_units")], events
    assert seen[190]["dead_units/inp"] == 0.0 and seen[200]["dead_units/inp"] == 0.75


def test_units_off_from_the_start_are_not_counted(tmp_path):
    """Units no input switched on from the first step (a deep narrow ReLU MLP at the default init
    has many, and trains as well as with an init that has few) did not die: not counted."""
    torch.manual_seed(0)
    model = Net(kill=48)
    model.kill_units()  # before the first step
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = {**quiet(), "stats": {"dead_units_samples": 5}}
    mon = sfmonitor.attach(model, optimizer, run_dir=str(tmp_path), sinks=[], config=cfg)
    for i in range(61):  # the last one sampled
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        mon.combine((model(x) - x[:, :1]).pow(2).mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert mon.stats["dead_units/inp"] == 0.0 and not [e for e in mon.events if e.kind == "dead_units"]
    mon.detach()


def test_a_healthy_relu_network_is_not_told(tmp_path):
    _, events, seen = _run(tmp_path, kill=0)
    assert not [e for e in events if e.kind == "dead_units"], events
    assert set(seen[50]) == {"dead_units/inp", "dead_units/hidden"}  # out: one unit, not counted
    assert max(seen[50].values()) < 0.2, seen[50]


def test_the_statistic_is_off_with_dead_units_every_0(tmp_path):
    _, events, seen = _run(tmp_path, kill=48, config={"stats": {"dead_units_every": 0}})
    assert not [e for e in events if e.kind == "dead_units"] and all(s == {} for s in seen)


def test_unused_embedding_rows_are_not_dead_units(tmp_path):
    """Half of the vocabulary never occurs: those rows of nn.Embedding have zero gradients, as
    designed (a row is a token, not a unit). Only the Linear layers count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Flatten(), nn.Linear(4 * 16, 32), nn.Tanh(), nn.Linear(32, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, optimizer, run_dir=str(tmp_path), sinks=[], config=quiet())
    for i in range(60):
        x = torch.randint(0, 32, (8, 4), generator=torch.Generator().manual_seed(i))
        loss = nn.functional.cross_entropy(model(x), x[:, 0])
        mon.combine(loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == 50:
            assert set(k for k in mon.stats if k.startswith("dead_units/")) == {"dead_units/2", "dead_units/4"}
    assert not [e for e in mon.events if e.kind == "dead_units"]
    mon.detach()


def test_zero_rows_are_rows_exactly_zero():
    conv = torch.zeros(4, 3, 2, 2)
    conv[1, 2, 1, 0] = 1e-30  # a tiny gradient is no zero
    conv[3, 0, 0, 0] = float("nan")
    assert S.zero_rows(conv).tolist() == [True, False, True, False]


def test_the_counter_counts_units_that_died_and_keeps_counts_through_an_all_zero_gradient():
    counter = S.DeadUnitCounter([(0, "g")], samples=2)

    def sample(*rows):
        values = S.read_all(counter.measure({0: torch.tensor(rows, dtype=torch.float32)}))
        counter.resolve(values)
        return values["dead_units/g"], counter.streaks[0].tolist()

    z = [0.0, 0.0]
    assert sample([1.0, 0.0], [1.0, 0.0], z, z) == (0.0, [0, 0, 1, 1])  # units 2, 3: not seen alive
    assert sample(z, z, z, z) == (0.0, [0, 0, 1, 1])  # an expert no token reached: says nothing
    assert sample(z, z, [0.0, 1.0], z) == (0.0, [1, 1, 0, 2])
    assert sample(z, [1.0, 0.0], z, z) == (0.25, [2, 0, 1, 3])  # unit 0 died; unit 3 never lived
    assert sample(z, z, z, z) == (0.25, [2, 0, 1, 3])


def test_the_detector_tells_once_per_group_until_the_share_falls_under_half_its_threshold():
    det = DeadUnits(DeadUnitsConfig(threshold=0.5))
    assert det.check(0, {"dead_units/a": 0.4, "loss/total": 1.0}) == []
    found = det.check(10, {"dead_units/a": 0.6, "dead_units/b": 0.7})
    assert [(f.where, f.data["share"]) for f in found] == [("a", 0.6), ("b", 0.7)]
    assert det.check(20, {"dead_units/a": 0.3, "dead_units/b": 0.9}) == []  # still over half of it
    assert det.check(30, {"dead_units/a": 0.2}) == []  # under half: re-armed
    assert [f.where for f in det.check(40, {"dead_units/a": 0.55})] == ["a"]
    state = det.state_dict()
    fresh = DeadUnits(DeadUnitsConfig(threshold=0.5))
    fresh.load_state_dict(state)
    assert fresh.check(50, {"dead_units/a": 0.9}) == []


@pytest.mark.parametrize("bad", [{"threshold": 0.0}, {"threshold": 1.5}])
def test_bad_thresholds_are_refused(bad):
    with pytest.raises(sfmonitor.ConfigError, match="threshold"):
        sfmonitor.MonitorConfig.from_dict({"detectors": {"dead_units": bad}})


def test_zero_rows_of_bf16_and_complex_gradients():
    g = torch.tensor([[0.0, 0.0], [0.0, -1.0]], dtype=torch.bfloat16)
    assert S.zero_rows(g).tolist() == [True, False]
    c = torch.zeros(2, 3, dtype=torch.complex64)
    c[1, 2] = 1j
    assert S.zero_rows(c).tolist() == [True, False]


def test_convolutions_are_watched_transposed_ones_and_small_layers_not(tmp_path):
    """A convolution's dim 0 is its output channels (watched); a transposed convolution's is its
    input channels (not units: not watched); a head of 4 units is under MIN_UNITS."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 3, padding=1),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 4),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, optimizer, run_dir=str(tmp_path), sinks=[], config=quiet())
    x = torch.randn(2, 3, 4, 4)
    mon.combine(model(x).pow(2).mean()).backward()
    optimizer.step()
    assert {k for k in mon.stats if k.startswith("dead_units/")} == {"dead_units/0"}
    mon.detach()
