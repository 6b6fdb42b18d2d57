"""One host read per healthy step, whatever form a sync takes.

tests/test_monitor.py spies on ``.item()`` and ``.tolist()`` only; a ``float(t)``, ``int(t)``,
``bool(t)`` (an ``if t:``), ``t.cpu()``, ``t.numpy()``, ``np.asarray(t)`` or an f-string of a
tensor added to the hot path would pass it. Here every tensor-to-host conversion is patched on
``torch.Tensor`` and counted two ways during whole training steps (forward, combine, backward,
optimizer step, zero_grad; fp32 and fp16 with a GradScaler), the watch and update ratios at
their defaults:

* by call site: conversions called directly from a module of sfmonitor; exactly one per healthy
  step is allowed, the stacked ``.tolist()`` in ``stats.read_all``;
* by difference: every conversion from anywhere (torch's own, called by sfmonitor, included),
  with the monitor minus without it over the same steps: exactly one more per step. The one
  exception, by design: a step that takes a rollback snapshot (the first healthy step, then one
  every ``actions.rollback.snapshot_every`` steps, default 50) copies model, optimizer and
  GradScaler state to host memory, and ``GradScaler.state_dict()`` reads the scale and growth
  tracker with ``.item()``; reads made under ``checkpoint.capture_state`` are counted apart.

Everything runs on CPU here, so "device" cannot tell a real sync from a no-op: the call is what
is counted. ``tensor.to("cpu")`` is not patched (on CPU it cannot be told from a host-to-device
``.to(device)``).
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from torch import nn

import sfmonitor

CONVERSIONS = (
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "__complex__",
    "__array__",
    "__format__",
    "item",
    "tolist",
    "numpy",
    "cpu",
)
STEPS = 18  # (past loopwrites.SAMPLE_EVERY: a step that samples the values written through .data)
READ_ALL = ("sfmonitor.stats", "read_all", "tolist")  # the one allowed read: (module, function, method)


class Net(nn.Module):
    """Two inputs, a fusion layer with an attention-like name (the watch hooks it) and a loss dict."""

    def __init__(self):
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.text = nn.Linear(5, 8)
        self.attn = nn.Linear(16, 3)

    def forward(self, x, t, y):
        hv, ht = self.vision(x), self.text(t)
        logits = self.attn(torch.cat([hv, ht], -1))
        return {"vision": hv.pow(2).mean(), "text": ht.abs().mean(), "fusion": nn.functional.cross_entropy(logits, y)}


WEIGHTS = {"vision": 0.4, "text": 0.3, "fusion": 0.3}


def _module_of(frame) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class HostReads:
    """Patch every conversion on torch.Tensor. ``all``: every call while ``on``; ``sites``:
    (module, function, method) of the calls made directly from sfmonitor; ``snapshot``: calls
    made under ``sfmonitor.checkpoint.capture_state`` (a rollback snapshot)."""

    def __init__(self, monkeypatch):
        self.sites: list[tuple[str, str, str]] = []
        self.lines: list[int] = []
        self.all = 0
        self.snapshot = 0
        self.on = False
        for name in CONVERSIONS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._spy(name, real))

    def _spy(self, name, real):
        def wrapper(tensor, *args, **kwargs):
            if self.on:
                self.on = False  # conversions inside the conversion are not new reads
                try:
                    self.all += 1
                    caller = sys._getframe(1)
                    module = _module_of(caller)
                    if module == "sfmonitor" or module.startswith("sfmonitor."):
                        self.sites.append((module, caller.f_code.co_name, name))
                        self.lines.append(caller.f_lineno)
                    frame = caller
                    while frame is not None:
                        if _module_of(frame) == "sfmonitor.checkpoint" and frame.f_code.co_name == "capture_state":
                            self.snapshot += 1
                            break
                        frame = frame.f_back
                finally:
                    self.on = True
            return real(tensor, *args, **kwargs)

        wrapper.__name__ = name
        return wrapper


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g))
        for _ in range(n)
    ]


def _train(reads: HostReads, monitor: bool, amp: bool, tmp_path) -> tuple[list[int], list[int]]:
    """STEPS healthy steps; returns the conversions counted in each (all frames), and those of
    them made under a rollback snapshot."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if amp else None
    mon = None
    if monitor:
        mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=tmp_path, sinks=[], config={"console": False})
    per_step, snapshots = [], []
    try:
        for x, t, y in _batches(STEPS):
            before, before_snapshot = reads.all, reads.snapshot
            reads.on = True
            try:
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                    losses = model(x, t, y)
                loss = mon.combine(losses, weights=WEIGHTS) if mon else sum(WEIGHTS[k] * v for k, v in losses.items())
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
                opt.zero_grad()
            finally:
                reads.on = False
            per_step.append(reads.all - before)
            snapshots.append(reads.snapshot - before_snapshot)
    finally:
        if mon is not None:
            assert not mon.events, f"the steps were meant to be healthy: {mon.events}"
            mon.detach()
    return per_step, snapshots


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "fp16+scaler"])
def test_one_host_read_per_healthy_step_by_call_site(monkeypatch, tmp_path, amp):
    reads = HostReads(monkeypatch)
    _train(reads, monitor=True, amp=amp, tmp_path=tmp_path)
    by_site = Counter(reads.sites)
    others = {site: n for site, n in by_site.items() if site != READ_ALL}
    assert not others, f"host reads besides stats.read_all's tolist(), {STEPS} steps: {others}"
    assert sum(by_site.values()) == STEPS, by_site


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "fp16+scaler"])
def test_the_monitor_adds_exactly_one_host_read_per_healthy_step(monkeypatch, tmp_path, amp):
    reads = HostReads(monkeypatch)
    without, none = _train(reads, monitor=False, amp=amp, tmp_path=tmp_path / "a")
    with_monitor, snapshot = _train(reads, monitor=True, amp=amp, tmp_path=tmp_path / "b")
    assert not any(none)
    added = [w - o - s for w, o, s in zip(with_monitor, without, snapshot)]
    assert added == [1] * STEPS, (
        f"conversions per step: without the monitor {without}, with it {with_monitor} "
        f"(of which under a snapshot {snapshot})"
    )
    # snapshots: the first healthy step only (snapshot_every defaults to 50); in fp32 no read at all
    assert all(n == 0 for n in snapshot[1:]) and (snapshot[0] == 0) == (not amp), snapshot


def test_the_spy_sees_every_form_of_read(monkeypatch):
    """The patching works: each conversion, called from a module named sfmonitor.*, is counted."""
    import numpy as np

    reads = HostReads(monkeypatch)
    code = compile(
        "def touch(t, i):\n"
        "    float(t); int(t); bool(t); complex(t); i.__index__(); t.item(); t.tolist(); t.cpu(); t.numpy()\n"
        "    np.asarray(t); f'{t:.2f}'\n",
        "<sfmonitor.fake>",
        "exec",
    )
    ns = {"__name__": "sfmonitor.fake", "np": np}
    exec(code, ns)
    reads.on = True
    ns["touch"](torch.tensor(1.5), torch.tensor(2))
    reads.on = False
    assert sorted({site[2] for site in reads.sites}) == sorted(CONVERSIONS), reads.sites


def test_the_step_statistics_read_nothing_inside_torch_ops():
    """A host read inside a torch op is invisible to the spies above: indexing with a 0-d tensor
    reads the index on the host (on a GPU, a device sync a step: three were found there, in the
    first non-finite gradient and parameter indices). On the meta device every such read raises
    ("item() cannot be called on meta tensors"), so the per-step helpers must run there, and their
    results stay on the device they measured."""
    from sfmonitor import stats as S
    from sfmonitor.undo import update_norms

    meta = torch.device("meta")
    for mask in (torch.zeros(6, dtype=torch.bool, device=meta), torch.zeros(0, dtype=torch.bool, device=meta)):
        assert S.first_true(mask).device == meta
    index = S.TensorIndex(
        group=torch.zeros(3, dtype=torch.long, device=meta),
        share=torch.ones(3, dtype=torch.float64, device=meta),
        position=torch.arange(3, device=meta),
    )
    assert index.param_of(S.first_true(torch.zeros(3, dtype=torch.bool, device=meta))).device == meta
    tensors = [torch.ones(4, device=meta), torch.ones(2, 3, dtype=torch.float16, device=meta)]
    per_tensor = S.norms(tensors)
    assert per_tensor.device == meta and S.group_norms(per_tensor[:2], index.group[:2], 1).device == meta
    assert update_norms(tensors, [t + 1 for t in tensors]).device == meta
    # bn_var_ratio/<group>: the BatchNorm layers' running variances (a cumulative average among them)
    layers = [("a", nn.BatchNorm1d(4, device=meta), 0), ("b", nn.BatchNorm2d(3, momentum=None, device=meta), 1)]
    bn = S.BatchVarRatio(layers, ["g0", "g1"])
    bn.rebase()
    measured = bn.measure()
    assert set(measured) == {S.BN_VAR_WORST, "bn_var_ratio/g0", "bn_var_ratio/g1"}
    assert all(v.device == meta for v in measured.values())


def test_first_true_and_param_of_give_the_first_offender():
    from sfmonitor import stats as S

    assert int(S.first_true(torch.tensor([False, False, True, True]))) == 2
    assert int(S.first_true(torch.tensor([False, False]))) == -1
    assert int(S.first_true(torch.zeros(0, dtype=torch.bool))) == -1
    index = S.TensorIndex(group=torch.zeros(3, dtype=torch.long), share=None, position=torch.tensor([4, 7, 9]))
    assert [int(index.param_of(torch.tensor(i))) for i in (0, 2, -1)] == [4, 9, -1]
