"""Replay of an anomaly bundle: reproduce a non-finite gradient, name the parameter, ablate.

The toy is a miniature of the report's late fusion: a text query sum-pooled over the tokens (not
length-normalised) attends over image tokens with an unscaled q @ k^T written inline, in fp16 under
CPU autocast. A long caption overflows the fusion logits; the vision and text losses stay finite.
"""

import json
import os
import shutil
import sys
from importlib.metadata import EntryPoint

import pytest
import torch
from torch import nn

from sfmonitor import replay as replay_module
from sfmonitor.forensics import BatchRecorder, BundleError, load_bundle, write_bundle
from sfmonitor.replay import FACTORY_GROUP, first_nonfinite_param, main, replay_bundle, trusted_factories

WEIGHTS = {"vision": 0.4, "text": 0.3, "fusion": 0.3}  # the report's L_total weights


class Fusion(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, img, txt):  # (B, P, d), (B, T, d)
        q = self.q(txt.sum(dim=1, keepdim=True))  # (B, 1, d): sum-pooled, grows with T
        k = self.k(img.relu())  # (B, P, d)
        att = (q @ k.transpose(-1, -2)).softmax(dim=-1)  # (B, 1, P), inline, unscaled, fp16
        return (att @ img).squeeze(1)  # (B, d)


class ToyFusion(nn.Module):
    def __init__(self, d=8, vocab=20, gain=1.0):
        super().__init__()
        self.vision = nn.Linear(4, d)
        self.drop = nn.Dropout(0.1)  # makes the replay depend on the RNG state
        self.text = nn.Embedding(vocab, d)
        self.fusion = Fusion(d)
        self.head_v = nn.Linear(d, 2)
        self.head_t = nn.Linear(d, 2)
        self.head_f = nn.Linear(d, 2)
        with torch.no_grad():  # positive weights: the scores overflow to +inf (-inf is harmless)
            self.text.weight.abs_()
            self.fusion.q.weight.abs_().mul_(gain)
            self.fusion.k.weight.abs_().mul_(gain)

    def forward(self, image, text, label):  # (B, P, 4), (B, T), (B,)
        img = self.drop(self.vision(image))
        txt = self.text(text)
        ce = nn.functional.cross_entropy
        return {
            "vision": ce(self.head_v(img.mean(1)).float(), label),
            "text": ce(self.head_t(txt.mean(1)).float(), label),
            "fusion": ce(self.head_f(self.fusion(img, txt)).float(), label),
        }


def build_toy(d=8, vocab=20, gain=1.0):
    torch.manual_seed(1)
    return ToyFusion(d=d, vocab=vocab, gain=gain)


MODEL_KWARGS = {"d": 8, "vocab": 20, "gain": 6.0}


def _batch(length, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "image": torch.randn(2, 3, 4, generator=g) * 3,
        "text": torch.randint(1, 20, (2, length), generator=g),
        "label": torch.randint(0, 2, (2,), generator=g),
    }


def _live_run(tmp_path, max_bytes=64 * 2**20):
    """A little training loop with the report's assertion; writes a bundle at the first NaN grad."""
    model = build_toy(**MODEL_KWARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = BatchRecorder().attach(model)
    for step, lengths in enumerate([(4, 8), (8, 16), (16, 400)]):  # 2 micro-batches a step
        rec.clear()
        opt.zero_grad()
        live_losses = []
        for i, n in enumerate(lengths):
            with torch.autocast("cpu", dtype=torch.float16):
                losses = model(**_batch(n, 10 * step + i))
            live_losses.append({k: float(v.detach()) for k, v in losses.items()})
            sum(WEIGHTS[k] * v for k, v in losses.items()).backward()
        # The live check of the report: the first parameter (named_parameters order) with NaN grad.
        live_param = next(
            (n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()), None
        )
        if live_param is not None:
            path = write_bundle(
                tmp_path,
                step,
                "nonfinite_grad",
                model_state=model.state_dict(),
                optimizer_state=opt.state_dict(),
                batch=rec.batches,
                rng_state=rec.rng_state,
                stats={"loss/total": float("nan")},
                event={"step": step, "kind": "nonfinite_grad", "message": "", "data": {"param": live_param}},
                model_factory=f"{__name__}:build_toy",
                model_kwargs=MODEL_KWARGS,
                loss_weights=WEIGHTS,
                max_bytes=max_bytes,
            )
            rec.detach()
            return path, live_param, live_losses
        opt.step()
    raise AssertionError("the toy never produced a non-finite gradient")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    torch.set_num_threads(1)
    return _live_run(tmp_path_factory.mktemp("run"))


def test_replay_reproduces_and_names_the_live_parameter(live):
    path, live_param, live_losses = live
    assert os.path.basename(path) == "2-nonfinite_grad"
    r = replay_bundle(path, factory=build_toy)
    assert r["reproduced"] is True and r["grad_nonfinite"]
    assert r["first_nonfinite_param"] == live_param and r["same_param"] is True
    assert r["first_nonfinite_module"] == "fusion"  # the inline logits overflowed there
    assert r["autocast"] == "float16" and r["micro_batches"] == 2
    # Same RNG state, autocast dtype and pre-step weights: the very same losses, micro-batch by micro-batch.
    for k in WEIGHTS:
        got = r["losses"][k]
        want = [mb[k] for mb in live_losses]
        assert got == pytest.approx(want, nan_ok=True, rel=0, abs=0), k


def test_ablation_singles_out_the_fusion_loss(live):
    path, _, _ = live
    r = replay_bundle(path, factory=build_toy, ablate=True)
    assert r["culprits"] == ["fusion"]
    assert r["removal_fixes"] == ["fusion"]
    rows = {row["component"]: row for row in r["ablation"]}
    assert not rows["vision"]["alone_nonfinite_grad"] and not rows["text"]["alone_nonfinite_grad"]
    assert rows["vision"]["without_nonfinite_grad"]  # fusion still in: still NaN


def test_cli_replay_with_model_and_ablate(live, capsys):
    path, live_param, _ = live
    assert main([path, "--model", f"{__name__}:build_toy", "--ablate"]) == 0
    out = capsys.readouterr().out
    assert "reproduced: yes" in out
    assert f"first non-finite parameter: {live_param}" in out
    assert "components producing the non-finite gradient: fusion" in out


def test_cli_refuses_untrusted_factory_from_the_bundle(live, capsys):
    path, _, _ = live
    assert main([path]) == 2
    err = capsys.readouterr().err
    assert "build_toy" in err and FACTORY_GROUP in err and "--model" in err


def _with_factory(src, dst, factory):
    """A copy of bundle ``src`` whose manifest names ``factory``."""
    shutil.copytree(src, dst)
    mpath = os.path.join(dst, "manifest.json")
    with open(mpath) as fh:
        manifest = json.load(fh)
    manifest["model_factory"] = factory
    with open(mpath, "w") as fh:
        json.dump(manifest, fh)
    return str(dst)


def test_a_bundle_cannot_make_replay_import_its_module(live, tmp_path, monkeypatch):
    """The factory a bundle names is imported only when a package registers it; a module on the
    path that is not registered is never imported, whatever the bundle says."""
    path, _, _ = live
    (tmp_path / "mods").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "mods" / "sfm_untrusted_factory.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef build(**kw):\n    raise AssertionError\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    for factory in ("sfm_untrusted_factory:build", "os:system", None):
        bundle = _with_factory(path, tmp_path / f"b{abs(hash(str(factory)))}", factory)
        # (none named: the run never called set_model_factory, and the error says how to pass one)
        why = "trusted from a file" if factory else r"names no model factory .*set_model_factory.*--model"
        with pytest.raises(BundleError, match=why):
            replay_bundle(bundle)
    assert not marker.exists() and "sfm_untrusted_factory" not in sys.modules


def test_factories_registered_under_the_entry_point_group_are_trusted(live, monkeypatch):
    path, live_param, _ = live
    registered = [EntryPoint(name="toy", value=f"{__name__}:build_toy", group=FACTORY_GROUP)]
    seen = []

    def fake_entry_points(*, group):
        seen.append(group)
        return [ep for ep in registered if ep.group == group]

    monkeypatch.setattr(replay_module, "entry_points", fake_entry_points)
    assert trusted_factories() == {f"{__name__}:build_toy"}
    r = replay_bundle(path)  # no factory given: the bundle's is registered
    assert r["reproduced"] is True and r["first_nonfinite_param"] == live_param
    assert seen and set(seen) == {FACTORY_GROUP}


def test_the_reference_model_registers_its_factory():
    pytest.importorskip("reference_model")
    assert "reference_model.model:build_model" in trusted_factories()


def test_replay_of_bundle_without_batch_says_why(tmp_path):
    path, _, _ = _live_run(tmp_path, max_bytes=8 * 1024)
    assert load_bundle(path)["manifest"]["batch_dropped"]
    with pytest.raises(BundleError, match="holds no batch to replay.*over the cap"):
        replay_bundle(path, factory=build_toy)


def test_replay_bad_factory(live):
    path, _, _ = live
    with pytest.raises(BundleError, match="'module:function'"):
        replay_bundle(path, factory="nocolon")
    with pytest.raises(BundleError, match="cannot import"):
        replay_bundle(path, factory="no_such_module_xyz:f")
    with pytest.raises(BundleError, match="does not fit"):
        replay_bundle(path, factory=lambda **kw: nn.Linear(2, 2))


def test_first_nonfinite_param_order():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert first_nonfinite_param(m) is None
    m(torch.ones(1, 2)).sum().backward()
    assert first_nonfinite_param(m) is None
    m[1].bias.grad[0] = float("inf")
    m[0].weight.grad[0, 0] = float("nan")
    assert first_nonfinite_param(m) == "0.weight"


def test_reference_model_factory_is_trusted_from_the_bundle(tmp_path):
    """The built-in factory: the Superfusion trap (huge Wq/Wk gain) overflows in `fusion`."""
    ref = pytest.importorskip("reference_model.model")
    data = pytest.importorskip("reference_model.data")
    factory = "reference_model.model:build_model"  # registered in pyproject.toml
    train, _, tok = data.make_synthetic(data.DataConfig(n_train=16, n_val=8))
    cfg = {"vocab_size": len(tok), "d_model": 16, "text_ff": 16, "qk_init_gain": 200.0}
    model = ref.build_model(cfg)
    rec = BatchRecorder().attach(model)
    with torch.autocast("cpu", dtype=torch.float16):
        losses = model(**train.collate(list(range(4))))
    assert not torch.isfinite(losses["fusion"])
    path = write_bundle(
        tmp_path,
        0,
        "nonfinite_loss",
        model_state=model.state_dict(),
        batch=rec.batches,
        rng_state=rec.rng_state,
        model_factory=factory,
        model_kwargs={"cfg": cfg},
        loss_weights=WEIGHTS,
    )
    r = replay_bundle(path, ablate=True)  # no factory given: the bundle's is trusted
    assert r["reproduced"] is True and r["first_nonfinite_module"] == "fusion"
    assert r["culprits"] == ["fusion"]


# -- malformed bundles, (logits, loss) models, --loss, --help -------------------------------------
class TupleGPT(nn.Module):
    """nanoGPT's convention: forward(idx, targets) returns (logits, loss)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        return logits, nn.functional.cross_entropy(logits.view(-1, 10), targets.view(-1))


def build_tuple_gpt():
    return TupleGPT()


def _on_demand_bundle(tmp_path, model, rec, loss, factory):
    """An on-demand bundle of ``model``'s step 0 (the batches ``rec`` recorded), rebuilt by
    ``factory`` (a function of this module)."""
    return write_bundle(
        tmp_path,
        0,
        "on_demand",
        model_state=model.state_dict(),
        optimizer_state={},
        batch=rec.batches,
        rng_state=rec.rng_state,
        stats={"loss/total": float(loss)},
        event={"step": 0, "kind": "on_demand", "message": ""},
        model_factory=f"{__name__}:{factory.__name__}",
        model_kwargs={},
        loss_weights={},
    )


def _tuple_bundle(tmp_path):
    torch.manual_seed(0)
    model = build_tuple_gpt()
    rec = BatchRecorder().attach(model)
    idx, targets = torch.randint(0, 10, (2, 5)), torch.randint(0, 10, (2, 5))
    _, loss = model(idx, targets)
    path = _on_demand_bundle(tmp_path, model, rec, loss, build_tuple_gpt)
    return path, float(loss)


def test_a_model_returning_logits_and_loss_replays(tmp_path):
    path, live_loss = _tuple_bundle(tmp_path)
    rep = replay_bundle(path, factory=build_tuple_gpt)
    assert rep["reproduced"] and rep["losses"]["total"] == [pytest.approx(live_loss)]


def loss_from_logits(output, batch):
    logits = output[0]
    return nn.functional.cross_entropy(logits.view(-1, 10), batch["kwargs"].get("targets", batch["args"][1]).view(-1))


def test_a_loss_hook_computes_the_loss_from_the_output(tmp_path, capsys):
    path, _ = _tuple_bundle(tmp_path)
    code = main([path, "--model", f"{__name__}:build_tuple_gpt", "--loss", f"{__name__}:loss_from_logits"])
    assert code == 0, capsys.readouterr()


def test_a_malformed_bundle_is_exit_2_with_a_message_not_a_traceback(tmp_path, capsys):
    path, _ = _tuple_bundle(tmp_path)
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        fh.write("{not json")
    assert main([path, "--model", f"{__name__}:build_tuple_gpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sfmonitor replay: ") and "Traceback" not in err
    # A model whose forward raises on the saved batch: a message, exit 2.
    path2, _ = _tuple_bundle(tmp_path / "b")
    assert main([path2, "--model", f"{__name__}:build_toy"]) == 2
    assert "sfmonitor replay: " in capsys.readouterr().err


def test_help_text_is_whole(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Exit status: 0 reproduced, 1 ran but did not reproduce, 2 bad bundle or arguments." in out
    assert "--loss" in out


def build_logits_only():
    torch.manual_seed(0)
    return nn.Linear(5, 3)  # its forward returns the output, not a loss


def test_a_model_whose_forward_returns_its_output_asks_for_a_loss_function(tmp_path, capsys):
    """A forward that returns logits (most models) is no loss: replay says to pass ``--loss``
    instead of failing on the tensor's size (a helper's probe: "ValueError: only one element
    tensors can be converted to Python scalars")."""
    model = build_logits_only()
    rec = BatchRecorder().attach(model)
    model(torch.randn(4, 5))
    path = _on_demand_bundle(tmp_path, model, rec, 1.0, build_logits_only)
    with pytest.raises(BundleError, match=r"--loss module:function.*shape \(4, 3\)"):
        replay_bundle(path, factory=build_logits_only)
    assert main([path, "--model", f"{__name__}:build_logits_only"]) == 2
    assert "--loss" in capsys.readouterr().err
