"""Input statistics, the batch recorder and anomaly bundles (atomic, size-capped, weights_only)."""

import json
import os
import random

import pytest
import torch
from torch import nn

from sfmonitor.events import ConfigError
from sfmonitor.forensics import (
    BatchRecorder,
    BundleConfig,
    BundleError,
    BundleTracker,
    batch_input_stats,
    capture_rng_state,
    input_stats,
    load_bundle,
    restore_rng_state,
    write_bundle,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, image, text=None, mask=None):
        return self.lin(image).sum()


# ---- input statistics ------------------------------------------------------------------------


def test_input_stats_float_int_and_padding():
    image = torch.tensor([[1.0, -3.0], [float("nan"), 2.0]])
    text = torch.tensor([[5, 6, 7, 0, 0], [1, 2, 0, 0, 0], [3, 3, 3, 3, 3]])
    s = input_stats((image,), {"batch": {"text": text, "mask": text != 0}, "n": 3})
    assert set(s) == {"arg0", "batch.text", "batch.mask"}
    img = s["arg0"]
    assert img["shape"] == [2, 2] and img["dtype"] == "float32"
    assert img["nonfinite"] == 1  # counted, and kept out of the numbers
    assert img["min"] == -3.0 and img["max"] == 2.0 and img["absmax"] == 3.0
    assert img["mean"] == pytest.approx(0.0) and img["std"] == pytest.approx(torch.tensor([1.0, -3, 2]).std().item())
    t = s["batch.text"]
    assert t["pad"] == 0 and (t["lengths_min"], t["lengths_max"]) == (2, 5)
    assert t["lengths_mean"] == pytest.approx(10 / 3) and t["max"] == 7
    assert (s["batch.mask"]["lengths_min"], s["batch.mask"]["lengths_max"]) == (2, 5)


def test_input_stats_no_padding_pattern_and_empty():
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    s = input_stats((tokens, torch.empty(0)))
    assert "lengths_min" not in s["arg0"] and "pad" not in s["arg0"]
    assert s["arg1"] == {"shape": [0], "dtype": "float32"}
    assert input_stats() == {}


def test_batch_input_stats_per_micro_batch():
    rec = [{"args": (torch.ones(2),), "kwargs": {}}, {"args": (), "kwargs": {"x": torch.zeros(3)}}]
    out = batch_input_stats(rec)
    assert out[0]["arg0"]["mean"] == 1.0 and out[1]["x"]["max"] == 0.0


# ---- batch recorder --------------------------------------------------------------------------


def test_batch_recorder_keeps_references_of_every_micro_batch():
    model = Net()
    rec = BatchRecorder().attach(model)
    xs = [torch.randn(3, 4) for _ in range(3)]
    tokens = torch.randint(0, 9, (3, 5))
    for i, x in enumerate(xs):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(i == 2)):
            model(x, text=tokens)
    assert len(rec.batches) == 3
    for x, b in zip(xs, rec.batches):
        assert b["args"][0].data_ptr() == x.data_ptr()  # a reference, not a copy
        assert b["kwargs"]["text"].data_ptr() == tokens.data_ptr()
    assert [b["autocast"] for b in rec.batches] == [None, None, "bfloat16"]
    with torch.no_grad():  # eval passes are not the step's batch
        model(xs[0])
    assert len(rec.batches) == 3
    rec.clear()
    assert rec.batches == [] and rec.rng_state is None
    rec.detach()
    assert not model._forward_pre_hooks
    model(xs[0])
    assert rec.batches == []


def test_batch_recorder_does_not_keep_graphs():
    model = Net()
    rec = BatchRecorder().attach(model)
    x = torch.randn(2, 4, requires_grad=True)
    model(x * 2)
    assert rec.batches[0]["args"][0].grad_fn is None
    rec.detach()


def test_rng_state_captured_at_first_forward_restores_draws():
    model = Net()
    rec = BatchRecorder().attach(model)
    torch.manual_seed(3)
    random.seed(4)
    model(torch.randn(1, 4))
    a = torch.rand(3)
    model(torch.randn(1, 4))  # the second micro-batch does not overwrite it
    restore_rng_state(rec.rng_state)  # the state as the first forward began
    assert torch.equal(torch.rand(3), a)
    assert set(rec.rng_state) <= {"torch", "cuda"}  # what a forward draws from; cheap per step
    rec.detach()


def test_capture_restore_numpy():
    np = pytest.importorskip("numpy")
    st = capture_rng_state()
    v = np.random.rand()
    restore_rng_state(st)
    assert np.random.rand() == v


# ---- bundles ---------------------------------------------------------------------------------


def _trained():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).backward()
    opt.step()
    return model, opt


def _write(tmp_path, **kw):
    model, opt = _trained()
    batch = [
        {
            "args": (torch.randn(2, 4),),
            "kwargs": {"text": torch.randint(0, 5, (2, 6))},
            "autocast": "float16",
            "device": "cpu",
        }
    ]
    args = dict(
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        batch=batch,
        stats={"loss/total": float("nan"), "grad_norm/total": 3.5},
        event={"step": 12, "kind": "nonfinite_loss", "message": "m", "data": {"param": "lin.weight"}},
        rng_state=capture_rng_state(),
        config={"strict": False},
        model_factory="pkg.mod:build",
        model_kwargs={"d": 4},
        loss_weights={"a": 0.4},
    )
    args.update(kw)
    return write_bundle(tmp_path, 12, "nonfinite_loss", **args), model, opt, batch


def test_bundle_round_trip(tmp_path):
    path, model, opt, batch = _write(tmp_path)
    assert path == os.path.join(tmp_path, "bundles", "12-nonfinite_loss")
    assert [p for p in os.listdir(os.path.join(tmp_path, "bundles"))] == ["12-nonfinite_loss"]
    b = load_bundle(path)
    for k, v in model.state_dict().items():
        assert torch.equal(b["model_state"][k], v)
    o = b["optimizer_state"]
    assert o["param_groups"][0]["lr"] == 1e-3
    assert torch.equal(o["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(b["batch"][0]["args"][0], batch[0]["args"][0])
    assert torch.equal(b["batch"][0]["kwargs"]["text"], batch[0]["kwargs"]["text"])
    assert b["stats"] == {"loss/total": "nan", "grad_norm/total": 3.5}
    assert b["event"]["data"]["param"] == "lin.weight" and b["config"] == {"strict": False}
    m = b["manifest"]
    assert (m["step"], m["kind"], m["autocast"], m["micro_batches"]) == (12, "nonfinite_loss", "float16", 1)
    assert m["model_factory"] == "pkg.mod:build" and m["model_kwargs"] == {"d": 4}
    assert m["loss_weights"] == {"a": 0.4} and m["batch_dropped"] is False and m["dropped"] == {}
    restore_rng_state(b["rng_state"])
    # A second bundle of the same step and kind does not overwrite the first.
    again = write_bundle(tmp_path, 12, "nonfinite_loss", model_state=model.state_dict())
    assert again.endswith("12-nonfinite_loss-2") and os.path.isdir(path)


def test_bundle_over_cap_is_written_without_the_batch(tmp_path):
    big = [{"args": (torch.randn(64, 1024),), "kwargs": {}, "autocast": None}]  # 256 KiB
    path, model, opt, _ = _write(tmp_path, batch=big, max_bytes=64 * 1024)
    m = json.load(open(os.path.join(path, "manifest.json")))
    assert m["batch_dropped"] is True
    assert "over the cap of 65536 bytes" in m["batch_dropped_reason"]
    assert m["bytes"] <= 64 * 1024
    assert not os.path.exists(os.path.join(path, "batch.pt"))
    b = load_bundle(path)
    assert b["batch"] is None and b["optimizer_state"] is not None
    assert torch.equal(b["model_state"]["lin.weight"], model.state_dict()["lin.weight"])


def test_bundle_batch_view_is_compacted(tmp_path):
    base = torch.randn(1000, 256)  # 1 MB storage; the view is 1 KB
    path, *_ = _write(tmp_path, batch=[{"args": (base[:1],), "kwargs": {}}], max_bytes=200 * 1024)
    b = load_bundle(path)
    assert not b["manifest"]["batch_dropped"] and torch.equal(b["batch"][0]["args"][0], base[:1])


def test_unloadable_batch_is_dropped_with_reason(tmp_path):
    class Custom:
        pass

    path, *_ = _write(tmp_path, batch=[{"args": (Custom(),), "kwargs": {}}])
    m = load_bundle(path)["manifest"]
    assert m["batch_dropped"] and "Custom" in m["batch_dropped_reason"]


class _Evil:
    """Unpickling this would create a file: weights_only must refuse before that happens."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_tampered_bundle_with_pickled_callable_is_refused(tmp_path):
    path, *_ = _write(tmp_path)
    target = tmp_path / "pwned"
    torch.save({"args": [_Evil(str(target))]}, os.path.join(path, "batch.pt"))
    with pytest.raises(BundleError, match=r"refusing .*batch\.pt.*weights_only=True"):
        load_bundle(path)
    assert not target.exists()
    torch.save({"fn": print}, os.path.join(path, "batch.pt"))
    with pytest.raises(BundleError, match="refusing"):
        load_bundle(path)


def test_bad_bundles_are_refused_clearly(tmp_path):
    with pytest.raises(BundleError, match="manifest.json is missing"):
        load_bundle(tmp_path)
    path, *_ = _write(tmp_path)
    mpath = os.path.join(path, "manifest.json")
    m = json.load(open(mpath))
    m["files"]["model"] = "../../evil.pt"
    json.dump(m, open(mpath, "w"))
    with pytest.raises(BundleError, match="outside the bundle"):
        load_bundle(path)
    m["format"] = 99
    json.dump(m, open(mpath, "w"))
    with pytest.raises(BundleError, match="unknown bundle format 99"):
        load_bundle(path)


def test_write_is_atomic_on_failure(tmp_path, monkeypatch):
    model, _ = _trained()
    calls = []

    def failing_save(obj, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(obj, path, *a, **k)

    real_save = torch.save
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        write_bundle(
            tmp_path, 3, "grad_spike", model_state=model.state_dict(), batch=[{"args": (torch.ones(2),), "kwargs": {}}]
        )
    assert os.listdir(os.path.join(tmp_path, "bundles")) == []  # no half bundle, no temp dir


def test_write_bundle_bad_arguments(tmp_path):
    model, _ = _trained()
    with pytest.raises(ValueError, match="kind"):
        write_bundle(tmp_path, 1, "../x", model_state=model.state_dict())
    with pytest.raises(ValueError, match="model_factory"):
        write_bundle(tmp_path, 1, "k", model_state=model.state_dict(), model_factory="nocolon")
    with pytest.raises(ValueError, match="model_kwargs"):
        write_bundle(tmp_path, 1, "k", model_state=model.state_dict(), model_kwargs={"f": print})
    with pytest.raises(BundleError, match="model_state"):
        write_bundle(tmp_path, 1, "k", model_state={"w": print})


def test_tracker_first_only_kinds_on_demand_and_state():
    t = BundleTracker()
    assert t.should_write("nonfinite_grad")
    t.mark("nonfinite_grad", 5)
    assert not t.should_write("nonfinite_grad") and t.should_write("grad_spike")
    assert t.should_write("nonfinite_grad", on_demand=True)
    t2 = BundleTracker()
    t2.load_state_dict(t.state_dict())
    assert t2.written == {"nonfinite_grad": 5}
    only = BundleTracker(BundleConfig(kinds=["nonfinite_loss"], first_only=False))
    assert only.should_write("nonfinite_loss") and not only.should_write("grad_spike")
    off = BundleTracker(BundleConfig(enabled=False, on_demand=False))
    assert not off.should_write("nonfinite_loss") and not off.should_write("x", on_demand=True)


def test_bundle_config_validation():
    assert BundleConfig().max_mb == 64.0
    with pytest.raises(ConfigError, match="bundle.dir"):
        BundleConfig.from_dict({"dir": "../up"}, prefix="bundle.")
    with pytest.raises(ConfigError, match="max_mb"):
        BundleConfig(max_mb=-1)


def test_a_nested_or_sparse_input_is_left_out_of_the_input_checks(tmp_path):
    """The input tally (a sum and a norm per tensor) raised NotImplementedError on a nested
    (jagged) input, in the model's forward (a probe); nested, sparse and float8 inputs are left
    out of the input checks, as an input that is no tensor is."""
    import sfmonitor

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x.values() if x.is_nested else x.to_dense()).mean()

    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    for make in (
        lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged),
        lambda: torch.randn(4, 3).to_sparse(),
    ):
        for _ in range(2):
            mon.combine(model(make())).backward()
            opt.step()
            opt.zero_grad()
    mon.detach()
    assert mon.step == 4 and not [e for e in mon.events if e.actions]


@pytest.mark.parametrize("layout", ["sparse", "nested"])
def test_an_anomaly_with_a_sparse_or_nested_input_is_rescued_and_its_evidence_names_them(tmp_path, layout):
    """A graph network's sparse adjacency (pytorch/examples' gcn), a jagged batch: at the first
    anomaly the evidence gathered on the inputs (forensics.input_stats) ran torch.isfinite on the
    sparse tensor, and optimizer.step() raised NotImplementedError in the user's loop (a probe).
    Such an input is described by its shape and layout; the step is skipped as usual, and its
    bundle written without a warning."""
    import warnings

    import sfmonitor

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x, adj):
            h = self.lin(x)
            return ((torch.sparse.mm(adj, h) if adj.is_sparse else h + adj.values().mean()) - 1).pow(2).mean()

    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    if layout == "sparse":
        adj = (torch.eye(6) + (torch.rand(6, 6, generator=g) < 0.3).float()).to_sparse()
    else:
        adj = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in mon.batches(range(30)):
            loss = model(torch.randn(6, 3, generator=g), adj) * (1e4 if i == 20 else 1.0)
            mon.combine(loss).backward()
            opt.step()
            opt.zero_grad()
    mon.detach()
    acted = [e for e in mon.events if e.actions]
    # (skipped where the loss detector sees it; the sparse run's 6-node batches are too noisy for
    # its prior: the gradient is clipped and the update undone)
    assert {e.step for e in acted} == {20} and acted[0].actions in (["skip_step"], ["clip"])
    (inputs,) = acted[0].data["inputs"]  # (one forward)
    assert inputs["arg1"]["layout"] == ("sparse_coo" if layout == "sparse" else "jagged")
    assert "mean" in inputs["arg0"] and "mean" not in inputs["arg1"]
    (batch,) = tmp_path.glob("bundles/20-*/batch.pt")  # the batch, its sparse or jagged input as it was
    (saved,) = torch.load(batch, weights_only=True)
    assert saved["args"][1].layout == adj.layout and saved["args"][1].is_nested == adj.is_nested
