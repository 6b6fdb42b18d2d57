"""sfmonitor/undo.py: the one reused copy behind an exact undo and the update ratio."""

from __future__ import annotations

import copy

import pytest
import torch
from _state import collector_runs
from torch import nn

from sfmonitor import sharding
from sfmonitor.checkpoint import capture_state, restore_state, save_checkpoint
from sfmonitor.undo import Scratch, UndoState, update_norms


def _trainer(model, opt, inputs):
    """One training step on fresh random inputs of ``inputs`` features, as a function."""

    def train():
        model(torch.randn(4, inputs)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return train


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum", "rmsprop"])
def test_restore_is_bit_exact_and_removes_state_a_first_step_created(opt_name):
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.1),
    }[opt_name]
    opt = make(model.parameters())
    params = list(model.parameters())
    undo = UndoState()
    train = _trainer(model, opt, 5)
    undo.capture(0, params, opt)  # before the first step: no optimizer state yet
    train()
    assert opt.state
    undo.restore(params, opt)
    assert not opt.state, "the state the undone step created is gone"
    train()
    train()
    before_w = copy.deepcopy(model.state_dict())
    before_s = copy.deepcopy(opt.state_dict())
    undo.capture(2, params, opt)
    train()
    undo.restore(params, opt)
    assert all(torch.equal(before_w[k], v) for k, v in model.state_dict().items())
    after_s = opt.state_dict()
    for pid, st in before_s["state"].items():
        for k, v in st.items():
            got = after_s["state"][pid][k]
            assert torch.equal(v, got) if isinstance(v, torch.Tensor) else v == got, (pid, k)
    assert undo.label == 2 and undo.nbytes > 0


@pytest.mark.parametrize("fused", [False, True], ids=["cpu-scratch", "gpu-foreach"])
@pytest.mark.parametrize("limit", [1 << 22, 10, 3])
def test_update_norms_in_bounded_chunks_match_the_direct_ones_and_keep_before(limit, fused):
    torch.manual_seed(0)
    before = [torch.randn(4, 3), torch.randn(7), torch.randn(2, 2, 2).half(), torch.randn(1)]
    after = [b + torch.randn_like(b) for b in before]
    kept = [b.clone() for b in before]
    scratch = Scratch()
    got = update_norms(before, after, scratch, limit=limit, fused=fused)
    want = torch.stack([torch.linalg.vector_norm((a - b).float()) for a, b in zip(after, before)])
    assert torch.allclose(got, want, rtol=1e-3)
    assert all(torch.equal(b, k) for b, k in zip(before, kept)), "the undo copy stays intact"
    assert all(buf.numel() <= max(limit, 1) for buf in scratch.buffers.values())


def test_update_norms_reuse_their_views_only_for_the_same_tensors():
    """The scratch keeps the views its differences are written into while ``before`` holds the
    same tensors (the undo copy, step after step); other tensors (a new layout: a parameter
    resized, a param group added) get views of their own shapes."""
    torch.manual_seed(0)
    scratch = Scratch()

    def check(before, after):
        got = update_norms(before, after, scratch, fused=False)
        want = update_norms(before, after, Scratch(), fused=False)  # (fresh: views built now)
        assert torch.equal(got, want)
        assert torch.allclose(got, torch.stack([(a - b).norm() for a, b in zip(after, before)]))

    before = [torch.randn(4, 3), torch.randn(7)]
    check(before, [b + torch.randn_like(b) for b in before])
    check(before, [b + torch.randn_like(b) for b in before])  # the same tensors: kept views
    other = [torch.randn(3, 4), torch.randn(2, 2)]  # same dtype, other shapes
    check(other, [b + torch.randn_like(b) for b in other])
    grown = [torch.randn(20, 3), torch.randn(7)]  # the buffer grows
    check(grown, [b + torch.randn_like(b) for b in grown])


@pytest.mark.parametrize("fused", [False, True], ids=["cpu-scratch", "gpu-foreach"])
def test_update_norms_of_many_tensors_of_two_kinds_come_in_their_order(fused):
    """600 tensors, every third in fp16: chunks per dtype (and, fused, of at most 256 tensors)
    whose norms are put back in the tensors' order, step after step with the kept plan."""
    torch.manual_seed(0)
    before = [torch.randn(3).half() if i % 3 == 0 else torch.randn(2, 2) for i in range(600)]
    scratch = Scratch()
    for _ in range(2):
        after = [b + torch.randn_like(b) for b in before]
        want = torch.stack([torch.linalg.vector_norm((a - b).float()) for a, b in zip(after, before)])
        got = update_norms(before, after, scratch, fused=fused)
        assert got.shape == (600,) and torch.allclose(got, want, rtol=1e-3)
    # and, with its plan kept, a call over 2,000 tensors runs the garbage collector no time
    many = [torch.randn(2) for _ in range(2000)]
    moved = [t + 1 for t in many]
    update_norms(many, moved, scratch, fused=fused)
    assert collector_runs(lambda: update_norms(many, moved, scratch, fused=fused)) == []


class _Wrapper(torch.optim.Optimizer):
    """A wrapper optimizer in the style of SAM and Lookahead: the param groups are its inner
    optimizer's, whose state (momentum) lives in the inner optimizer's own ``state``; the wrapper's
    ``state`` holds its own (SAM's saved weights, Lookahead's slow weights)."""

    def __init__(self, params):
        super().__init__(params, {})
        self.base_optimizer = torch.optim.SGD(self.param_groups, lr=0.1, momentum=0.9)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["old_p"] = p.detach().clone()
        self.base_optimizer.step()


def test_a_wrapper_optimizers_inner_state_is_put_back_too():
    """SAM's momentum lives in its base_optimizer's state, not in SAM's: an undo that copied only
    the optimizer it was given left the undone step's momentum in place."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = _Wrapper(model.parameters())
    params = list(model.parameters())
    undo = UndoState()
    train = _trainer(model, opt, 3)
    train()
    train()
    inner_before = copy.deepcopy(opt.base_optimizer.state_dict())
    own_before = copy.deepcopy(opt.state_dict())
    undo.capture(2, params, opt)
    train()
    undo.restore(params, opt)
    for a, b in ((opt.base_optimizer.state_dict(), inner_before), (opt.state_dict(), own_before)):
        for pid, st in b["state"].items():
            for k, v in st.items():
                assert torch.equal(a["state"][pid][k], v), (pid, k)
    assert undo.nbytes >= 2 * sum(p.numel() * p.element_size() for p in params)  # momentum and old_p too


def test_a_snapshot_holds_a_wrapper_optimizers_inner_state(tmp_path):
    """A rollback snapshot (and the emergency checkpoint made from one) held the optimizer's own
    ``state_dict()`` only: under SAM or Lookahead a rollback put the weights back and left the
    momentum of the steps it undid in the inner optimizer. It holds the inner state too, and the
    checkpoint file still loads with plain ``torch.load(weights_only=True)``."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = _Wrapper(model.parameters())
    train = _trainer(model, opt, 3)
    train()
    train()
    weights = copy.deepcopy(model.state_dict())
    inner = copy.deepcopy(opt.base_optimizer.state_dict())
    lr = opt.param_groups[0]["lr"]
    state = capture_state(model, opt)
    save_checkpoint(tmp_path / "snap.pt", state)
    train()
    train()
    opt.param_groups[0]["lr"] = lr / 2  # the user's schedule moved on: kept (keep_hyperparams)
    for snapshot in (state, torch.load(tmp_path / "snap.pt", weights_only=True)):
        restore_state(snapshot, model, opt)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), weights.values()))
        got = opt.base_optimizer.state_dict()["state"]
        assert set(got) == set(inner["state"])
        for pid, st in inner["state"].items():
            for k, v in st.items():
                assert torch.equal(got[pid][k], v), (pid, k)
        assert opt.param_groups is opt.base_optimizer.param_groups  # the wrapper still shares its groups
        assert opt.param_groups[0]["lr"] == lr / 2
        train()  # the restored momentum belongs to the live parameters: training goes on
        assert opt.base_optimizer.state[next(model.parameters())]["momentum_buffer"] is not None


def test_the_copy_is_one_buffer_per_dtype_with_the_live_strides_and_restores_bit_exact():
    """The parameters' copies (and the optimizer state's) are views of one flat buffer per dtype
    and device, filled by one fused copy each: on a GPU a copy per tensor was a kernel launch each,
    ~580 a step for AdamW on a 150M-parameter transformer. A channels_last weight and a transposed
    one keep their strides in the copy; a parameter whose elements do not fill one block of its
    storage (a strided slice) is copied in its logical order. Restores stay bit-exact."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    sliced = nn.Parameter(torch.randn(4, 6)[:, ::2])  # not dense: a gap after each element
    transposed = nn.Parameter(torch.randn(3, 5).t())
    half = nn.Parameter(torch.randn(5).half())
    params = [conv.weight, conv.bias, sliced, transposed, half]
    assert not sliced.is_contiguous() and not transposed.is_contiguous()
    opt = torch.optim.AdamW(params, lr=0.1)

    def train():
        x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
        loss = conv(x).mean() + sliced.sum() + (transposed @ torch.randn(3)).sum() + half.float().square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    undo = UndoState()
    train()
    weights = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    undo.capture(1, params, opt)
    train()
    undo.restore(params, opt)
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    for pid, st in state["state"].items():
        for k, v in st.items():
            assert torch.equal(opt.state_dict()["state"][pid][k], v), (pid, k)
    assert undo.params[0].stride() == conv.weight.stride() and undo.params[3].stride() == transposed.stride()
    assert undo.params[2].is_contiguous()
    storages = {(p.dtype, p.untyped_storage().data_ptr()) for p in undo.params}
    assert len(storages) == 2, "one buffer for the float32 parameters, one for the float16 one"
    moments = [v for owner in undo._state for st in owner if st for v in st.values() if v.dim() > 0]
    assert len({v.untyped_storage().data_ptr() for v in moments if v.dtype == torch.float32}) == 1
    held = undo.params
    undo.capture(2, params, opt)
    assert undo.params is held, "the same layout reuses the same copy (no allocation a step)"


def test_a_parameter_given_new_storage_is_copied_from_its_new_storage():
    """The copy's flat views of the live tensors are kept between steps; a ``p.data = ...`` (a
    resize, a load that replaces the storage) must not leave them reading the old storage."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    train = _trainer(model, opt, 4)
    undo = UndoState()
    train()
    undo.capture(1, params, opt)
    train()
    model.weight.data = torch.randn(3, 4)  # new storage, same layout
    opt.state[model.weight]["momentum_buffer"] = torch.randn(3, 4)  # so is the optimizer's
    weight, momentum = model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"].clone()
    undo.capture(2, params, opt)
    train()
    undo.restore(params, opt)
    assert torch.equal(model.weight, weight) and torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)


def test_a_capture_after_the_parameters_changed_holds_the_new_set():
    """A parameter added between captures (a frozen part unfrozen into the optimizer): the copy is
    made anew, and the optimizer state kept per parameter position is made anew with it, so the
    restore puts every parameter and its state back, none taken for another's."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 2)
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)

    def train():
        b(a(torch.randn(4, 3))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    undo = UndoState()
    train()
    undo.capture(1, list(a.parameters()), opt)
    opt.add_param_group({"params": list(b.parameters())})
    train()
    params = list(b.parameters()) + list(a.parameters())  # a new order and a longer list
    weights = [p.detach().clone() for p in params]
    state = {id(p): opt.state[p]["momentum_buffer"].clone() for p in params}
    undo.capture(2, params, opt)
    train()
    undo.restore(params, opt)
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], state[id(p)]) for p in params)


class _Replacing(torch.optim.Optimizer):
    """Momentum SGD that keeps its state the way some hand-written optimizers do: a new tensor in
    the state dict at every step (not updated in place), a plain int beside it, and a state entry
    that appears only from the third step on."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["m"] = 0.9 * st["m"] + p.grad if "m" in st else p.grad.clone()
                st["n"] = st.get("n", 0) + 1
                if st["n"] >= 3:
                    st["late"] = st.get("late", torch.zeros_like(p)) + p.grad.abs()
                p.sub_(group["lr"] * st["m"])


def _state_equal(before: dict, after: dict) -> None:
    """Two ``optimizer.state_dict()["state"]``: the same entries (in any order), equal values."""
    assert before.keys() == after.keys()
    for pid, st in before.items():
        assert set(st) == set(after[pid]), (pid, list(st), list(after[pid]))
        for k, v in st.items():
            got = after[pid][k]
            assert torch.equal(v, got) if isinstance(v, torch.Tensor) else v == got, (pid, k)


def _undo_some_steps(opt, model, steps: int, undone, redo=lambda: None) -> None:
    """Capture before every step (as the monitor does); after each step in ``undone``, restore
    and check that weights and optimizer state are exactly as captured, then make the step again
    (``redo``: what the optimizer must know of it) and go on."""
    params = list(model.parameters())
    undo = UndoState()
    train = _trainer(model, opt, 5)
    for step in range(steps):
        undo.capture(step, params, opt)
        before_w = copy.deepcopy(model.state_dict())
        before_s = copy.deepcopy(opt.state_dict()["state"])
        train()
        if step in undone:
            undo.restore(params, opt)
            redo()
            assert all(torch.equal(before_w[k], v) for k, v in model.state_dict().items()), step
            _state_equal(before_s, opt.state_dict()["state"])
            train()


@pytest.mark.parametrize("opt_name", ["adamw", "replacing"])
def test_every_capture_holds_the_state_as_it_is_at_that_capture(opt_name):
    """A capture reuses its last walk of the optimizer state only while that state holds the same
    tensors; captured at every step (as the monitor does), each restore puts back exactly the
    state of its own capture, also where the optimizer replaces its state tensors, keeps plain
    values, or grows a new entry."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1) if opt_name == "adamw" else _Replacing(model.parameters())
    _undo_some_steps(opt, model, 6, undone=(2, 4))


class _Reshaping(torch.optim.Optimizer):
    """Momentum SGD whose state changes its entries at given steps: ``late`` appears at the
    second, ``m`` moves to ``m2`` (the same tensor) at the third, ``tmp`` goes at the fourth and
    ``m2`` moves back to ``m`` at the fifth."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})
        self.count = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["m"], st["tmp"] = torch.zeros_like(p), torch.ones_like(p)
                key = "m2" if "m2" in st else "m"
                st[key].mul_(0.9).add_(p.grad)
                if self.count == 2:
                    st["late"] = p.grad.abs()
                if self.count == 3:
                    st["m2"] = st.pop("m")
                if self.count == 4:
                    del st["tmp"]
                if self.count == 5:
                    st["m"] = st.pop("m2")
                p.sub_(group["lr"] * st["m2" if "m2" in st else "m"])

    def redo(self):
        self.count -= 1  # (the undone step is made again: its change of entries with it)


def test_an_undo_puts_back_state_entries_the_step_added_removed_or_moved():
    """The undone step added an entry (it goes), removed one or moved a tensor to another key (it
    comes back, under its key): the state is as it was, and the optimizer steps on from it. Before,
    an undo of a step that moved ``m`` to ``m2`` failed with KeyError('m'), and one that removed an
    entry too; the capture after a move, reusing its last walk, kept the copy under the old key."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    opt = _Reshaping(model.parameters())
    _undo_some_steps(opt, model, 7, undone=range(7), redo=opt.redo)  # every step undone once
    assert all(set(st) == {"m", "late"} for st in opt.state.values())


def test_a_capture_after_an_entry_moved_to_another_key_holds_it_under_the_new_key():
    """The same state dict, the same tensor, in the same place, under another key: the capture's
    last walk of the state is not reused (it would keep the copy under the old key, and the undo
    would put the tensor back under it)."""
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    t = torch.zeros(3)
    opt.state[p] = {"m": t}
    undo = UndoState()
    undo.capture(0, [p], opt)
    opt.state[p]["m2"] = opt.state[p].pop("m")  # (a step that renames, not undone)
    t.add_(1)
    undo.capture(1, [p], opt)
    t.add_(1)  # the step to undo
    undo.restore([p], opt)
    assert list(opt.state[p]) == ["m2"] and torch.equal(opt.state[p]["m2"], torch.ones(3))


class _ShardLike(nn.Parameter):
    """A parameter taken for a DTensor (the test makes ``sharding.is_sharded`` see its class as
    DTensor's): ``to_local()`` gives its shard, itself here."""

    def to_local(self):
        return self


def test_an_undo_that_cannot_remake_a_sharded_entry_says_so_before_writing_anything(monkeypatch):
    """A DTensor entry the undone step removed cannot be made again from this rank's copy: the
    undo raises, naming the entries, before it has put anything back (no half-restored state)."""
    monkeypatch.setattr(sharding, "_DTENSOR", _ShardLike)
    p = _ShardLike(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = {"m": torch.zeros(3), "keep": torch.zeros(3)}
    undo = UndoState()
    undo.capture(0, [p], opt)
    with torch.no_grad():
        p.add_(1)
    del opt.state[p]["m"]
    opt.state[p]["new"] = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"\['m'\]"):
        undo.restore([p], opt)
    assert set(opt.state[p]) == {"keep", "new"} and torch.equal(p.detach(), torch.full((3,), 2.0))


def test_a_capture_of_an_unchanged_layout_makes_no_object_per_tensor():
    """Each step's capture of a model with many tensors makes nothing per tensor that lives
    through the capture (no list of keys, no detached alias per parameter): thousands of such
    objects at once, every step, ran Python's garbage collector several times a step, and its full
    collections grew with the model (96 blocks, 1,160 parameters: 126 ms a step over bare, 56 now).
    Counted as the collector's own runs during a capture of 4,000 tensors: none (17 before)."""
    params = [nn.Parameter(torch.randn(4)) for _ in range(1000)]
    opt = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones(4)
    opt.step()  # (state: 3 tensors a parameter)
    undo = UndoState()
    undo.capture(0, params, opt)  # (the first builds its layout)
    runs = collector_runs(lambda: undo.capture(1, params, opt))
    assert runs == []
    assert undo.label == 1 and torch.equal(undo.params[0], params[0].detach())


def test_norms_of_many_tensors_are_those_of_one_fused_call():
    """Over a few hundred tensors the norms are taken in slices, so that their results (a tensor
    object each) never reach the garbage collector's threshold together: no collector run (two per
    call over 2,000 tensors before), and the same values, in order, as one call over all of them."""
    from sfmonitor.stats import norms

    torch.manual_seed(0)
    tensors = [torch.randn(3, i % 5 + 1) for i in range(1000)] + [torch.randn(2).half()]
    want = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    assert torch.equal(norms(tensors), want)
    assert torch.equal(norms(tensors[:7]), want[:7])
    many = [torch.randn(2) for _ in range(2000)]
    assert collector_runs(lambda: norms(many)) == []


def test_the_parameters_are_measured_as_they_are_under_no_grad():
    """``Layout.detached``, which the monitor's per-step measurements call under ``no_grad``,
    gives plain parameters as they are there (no new tensor object per parameter a step); where
    gradients are recorded it still gives detached aliases (nothing recorded reads them)."""
    from sfmonitor.sharding import Layout, same_objects

    params = [nn.Parameter(torch.randn(3)) for _ in range(5)]
    layout = Layout(params)
    with torch.no_grad():
        assert same_objects(layout.detached(params), params)
    aliases = layout.detached(params)
    assert not any(a is p or a.requires_grad for a, p in zip(aliases, params))
    assert all(a.data_ptr() == p.data_ptr() for a, p in zip(aliases, params))
