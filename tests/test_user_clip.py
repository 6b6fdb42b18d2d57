"""Gradients as backward made them: when the user clips before ``optimizer.step()``, the statistics
and detectors see the unclipped, unscaled gradients, and the ``clip`` action never clips twice
(sfmonitor/userclip.py)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _integration_helpers import needs_fsdp2_on_cpu
from _state import quiet
from torch import nn

# Imported by name before any monitor attaches: clip_grad_norm_ reaches the wrapped
# _clip_grads_with_norm_ through its module's globals all the same.
from torch.nn.utils import clip_grad_norm_ as clip_imported_early

import sfmonitor
from sfmonitor import userclip

ORIGINALS = {
    (torch.nn.utils.clip_grad, "_clip_grads_with_norm_"): torch.nn.utils.clip_grad._clip_grads_with_norm_,
    (torch.nn.utils, "clip_grads_with_norm_"): torch.nn.utils.clip_grads_with_norm_,
    (torch.nn.utils.clip_grad, "clip_grad_value_"): torch.nn.utils.clip_grad.clip_grad_value_,
    (torch.nn.utils, "clip_grad_value_"): torch.nn.utils.clip_grad_value_,
}
GROUPS = ("0", "2")  # the Linear layers of the Sequential: one group each


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def data(n=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    # targets far from the start: gradient norms well above the clip thresholds used here
    return [(torch.randn(16, 6, generator=g), 10 * torch.randn(16, 1, generator=g)) for _ in range(n)]


def norms_by_hand(model):
    """grad_norm/<group> and grad_norm/total of the gradients as they are now, computed plainly."""
    per = {
        g: torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model[int(g)].parameters()])) for g in GROUPS
    }
    total = torch.linalg.vector_norm(torch.stack(list(per.values())))
    return {f"grad_norm/{g}": float(v) for g, v in per.items()} | {"grad_norm/total": float(total)}


def train(model, opt, batches, mon=None, clip=1.0, spike_at=None, seen=None):
    """The nanoGPT loop: backward, clip_grad_norm_, step. ``seen``: each step's norms by hand,
    before the clip."""
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        (mon.combine(loss) if mon else loss).backward()
        if i == spike_at:
            for p in model.parameters():
                p.grad.mul_(1000)
        if seen is not None:
            seen.append(norms_by_hand(model))
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if mon is not None and seen is not None:
            seen[-1]["stats"] = mon.stats


def same_state(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_statistics_are_of_the_gradients_before_the_users_clip_per_group_and_total(tmp_path):
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    for x, y in data(3, seed=2):  # no clip: the statistics and their keys as ever
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        expected = norms_by_hand(model)
        opt.step()
        opt.zero_grad()
        stats = mon.stats
        assert not any(k.startswith("grad_clip/") for k in stats)
        for key, value in expected.items():
            assert stats[key] == pytest.approx(value, rel=1e-6)
    seen = []
    train(model, opt, data(12), mon, clip=1.0, seen=seen)
    mon.detach()
    for s in seen:
        stats = s.pop("stats")
        assert s["grad_norm/total"] > 1.5  # the clip engaged: the optimizer got a norm of 1.0
        for key, value in s.items():
            assert stats[key] == pytest.approx(value, rel=1e-6), key
        assert stats["grad_clip/user"] == 1.0
        assert stats["grad_clip/coef"] == pytest.approx(1.0 / s["grad_norm/total"], rel=1e-5)


def test_a_gradient_spike_is_detected_although_the_user_clipped(tmp_path):
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    train(model, opt, data(40), mon, clip=1.0, spike_at=32)
    mon.detach()
    spikes = [e for e in mon.events if e.kind == "grad_spike"]
    assert [e.step for e in spikes] == [32]
    assert spikes[0].data["value"] > 1000  # the gradients as backward made them, not the clipped 1.0


def _spiked_runs(tmp_path, max_grad_norm, mode="global", **policy):
    batches = data(40)
    bare, bare_opt = make()
    train(bare, bare_opt, batches, clip=1.0, spike_at=32)
    model, opt = make()
    cfg = quiet(actions={"clip": {"mode": mode, "max_grad_norm": max_grad_norm}}, policy=policy)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=cfg)
    train(model, opt, batches, mon, clip=1.0, spike_at=32)
    mon.detach()
    (spike,) = [e for e in mon.events if e.kind == "grad_spike"]
    return bare, model, mon, spike


def test_the_clip_action_does_not_clip_again_under_the_users_clip(tmp_path):
    # The monitor's threshold is the user's own: clipping again would shrink the gradients by
    # 1 / (1 + 1e-6) and more; the run must stay the bare run with the user's clip alone.
    bare, model, mon, spike = _spiked_runs(tmp_path, max_grad_norm=1.0, budget_actions=["clip"])
    assert spike.actions == ["clip"]
    result = spike.data["action_results"]["clip"]
    assert result["clipped"] is False and result["applied"] is False, result
    assert "already bounded" in result["reason"] and result["user_clipped"] is True
    assert result["norm_before"] == pytest.approx(1.0, rel=1e-5)
    assert same_state(model, bare), "the user's clip alone: parameters equal the bare run"
    assert mon.summary()["rescues_used"] == 0  # an action that changed nothing spends no rescue


def test_the_zclip_default_does_not_clip_again_either(tmp_path):
    bare, model, _, spike = _spiked_runs(tmp_path, max_grad_norm=1.0, mode="zclip")
    result = spike.data["action_results"]["clip"]
    assert result["mode"] == "zclip" and result["clipped"] is False, result
    assert same_state(model, bare)


def test_the_clip_action_still_clips_below_the_users_threshold(tmp_path):
    bare, model, _, spike = _spiked_runs(tmp_path, max_grad_norm=0.25)
    result = spike.data["action_results"]["clip"]
    assert result.get("clipped", True) is not False and result["user_clipped"] is True, result
    assert result["norm_before"] == pytest.approx(1.0, rel=1e-5)
    assert result["norm_after"] == pytest.approx(0.25, rel=1e-4)
    assert not same_state(model, bare)


def test_gradscaler_unscale_then_clip_statistics_are_unscaled_and_unclipped(tmp_path):
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=str(tmp_path), config=quiet())
    for x, y in data(8):
        scaler.scale(mon.combine(nn.functional.mse_loss(model(x), y))).backward()
        scaler.unscale_(opt)
        expected = norms_by_hand(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        stats = mon.stats
        assert expected["grad_norm/total"] > 1.0
        for key, value in expected.items():
            assert stats[key] == pytest.approx(value, rel=1e-6), key
        assert stats["amp/loss_scale"] == 1024.0 and stats["grad_clip/user"] == 1.0
    mon.detach()


def test_a_clip_of_still_scaled_gradients_is_told_and_measured_at_the_step(tmp_path):
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=str(tmp_path), config=quiet())
    x, y = data(1)[0]
    scaler.scale(mon.combine(nn.functional.mse_loss(model(x), y))).backward()
    with pytest.warns(RuntimeWarning, match=r"scaler\.unscale_\(optimizer\) before clipping"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)  # the bug: clips before unscale_
    scaler.unscale_(opt)
    expected = norms_by_hand(model)  # what the optimizer gets: never a scaled norm
    scaler.step(opt)
    scaler.update()
    assert mon.stats["grad_norm/total"] == pytest.approx(expected["grad_norm/total"], rel=1e-6)
    assert "grad_clip/user" not in mon.stats
    mon.detach()


def test_detach_restores_the_torch_functions_in_any_order():
    (m1, o1), (m2, o2) = make(0), make(1)
    for first_out in (0, 1):
        mons = [sfmonitor.attach(m1, o1, config=quiet()), sfmonitor.attach(m2, o2, config=quiet())]
        for (module, name), original in ORIGINALS.items():
            assert getattr(module, name) is not original, name  # wrapped while attached
        assert {n for _, n, _ in userclip.wrapped_functions()} == {n for _, n in ORIGINALS}
        mons[first_out].detach()
        assert all(getattr(module, name) is not original for (module, name), original in ORIGINALS.items())
        mons[1 - first_out].detach()
        for (module, name), original in ORIGINALS.items():
            assert getattr(module, name) is original, name
        assert userclip.wrapped_functions() == []


def test_a_healthy_run_with_user_clipping_ends_bit_identical_to_the_bare_run(tmp_path):
    def run(mon=None, model_opt=None):
        model, opt = model_opt
        for i, (x, y) in enumerate(data(30)):
            loss = nn.functional.mse_loss(model(x), y)
            (mon.combine(loss) if mon else loss).backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 2.0)
            clip_imported_early((p for p in model.parameters()), 1.0)  # a generator, by an early import
            opt.step()
            opt.zero_grad()
            if mon is not None:
                assert mon.stats["grad_clip/user"] == 1.0, i  # the monitor saw the user's clips
        return model

    bare = run(model_opt=make())
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    run(mon, (model, opt))
    mon.detach()
    assert mon.events == []
    assert same_state(model, bare), "a healthy monitored run with user clipping ends bit-identical to the bare one"


def test_the_first_clip_of_unchanged_gradients_counts_and_a_later_change_is_measured_at_the_step(tmp_path):
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    (x, y), (x2, y2) = data(2)
    # a value clip, then a norm clip of the same gradients: the statistics are from before both
    mon.combine(nn.functional.mse_loss(model(x), y)).backward()
    expected = norms_by_hand(model)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    assert mon.stats["grad_norm/total"] == pytest.approx(expected["grad_norm/total"], rel=1e-6)
    # a clip, then another micro-batch accumulated into the gradients: what the optimizer gets
    mon.combine(nn.functional.mse_loss(model(x), y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    mon.combine(nn.functional.mse_loss(model(x2), y2)).backward()
    expected = norms_by_hand(model)
    opt.step()
    opt.zero_grad()
    assert mon.stats["grad_norm/total"] == pytest.approx(expected["grad_norm/total"], rel=1e-6)
    assert "grad_clip/user" not in mon.stats
    mon.detach()


def test_gradient_accumulation_measures_the_accumulated_gradients_at_the_clip(tmp_path):
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    batches = data(4)
    for x, y in batches:  # four micro-batches, one clip, one step
        mon.combine(nn.functional.mse_loss(model(x), y) / len(batches)).backward()
    expected = norms_by_hand(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    assert mon.stats["grad_norm/total"] == pytest.approx(expected["grad_norm/total"], rel=1e-6)
    mon.detach()


def test_a_clip_of_one_group_shows_that_group_before_its_clip_and_the_others_as_they_are(tmp_path):
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    x, y = data(1)[0]
    mon.combine(nn.functional.mse_loss(model(x), y)).backward()
    expected = norms_by_hand(model)
    torch.nn.utils.clip_grad_norm_(model[2].parameters(), 0.01)
    torch.nn.utils.clip_grad_value_(model[2].bias, 1e-4)  # a single tensor, clipped again
    for p in model[0].parameters():
        p.grad.mul_(3.0)  # changed by hand, not by a clip: seen as the optimizer gets it
    expected["grad_norm/0"] *= 3.0
    opt.step()
    stats = mon.stats
    assert stats["grad_norm/2"] == pytest.approx(expected["grad_norm/2"], rel=1e-6)
    assert stats["grad_norm/0"] == pytest.approx(expected["grad_norm/0"], rel=1e-6)
    total = (expected["grad_norm/0"] ** 2 + expected["grad_norm/2"] ** 2) ** 0.5
    assert stats["grad_norm/total"] == pytest.approx(total, rel=1e-6)
    mon.detach()


def test_a_nan_spread_by_the_users_clip_is_named_at_its_source(tmp_path):
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    x, y = data(1)[0]
    mon.combine(nn.functional.mse_loss(model(x), y)).backward()
    model[2].weight.grad[0, 3] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # every gradient is NaN now
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    mon.detach()
    (event,) = [e for e in mon.events if e.kind == "nonfinite_grad"]
    assert event.data["param"] == "2.weight" and event.data["count"] == 1, event.data
    assert event.actions == ["skip_step"]
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_driven_externally_the_clip_before_or_after_the_statistics_is_measured_once(tmp_path):
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet()).drive_externally()
    for i, (x, y) in enumerate(data(4)):
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        expected = norms_by_hand(model)
        if i % 2:  # Lightning: before_update(), then its clip (the statistics were taken already)
            mon.before_update()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:  # the HF Trainer: its clip, then on_pre_optimizer_step calls before_update()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            mon.before_update()
        opt.step()
        opt.zero_grad()
        assert mon.stats["grad_norm/total"] == pytest.approx(expected["grad_norm/total"], rel=1e-6), i
        assert ("grad_clip/user" in mon.stats) == (i % 2 == 0), i
    mon.detach()


def test_bad_input_to_a_wrapped_clip_gets_torchs_own_error_and_changes_nothing(tmp_path):
    model, opt = make()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    x, y = data(1)[0]
    mon.combine(nn.functional.mse_loss(model(x), y)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="not iterable"):
        torch.nn.utils.clip_grad_value_(3, 1.0)
    with pytest.raises(TypeError):
        torch.nn.utils.clip_grad_norm_(model.parameters(), None)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # the wrappers still work after torch's errors
    opt.step()
    assert mon.stats["grad_norm/total"] == pytest.approx(float(torch.stack([g.norm() for g in grads]).norm()), 1e-6)
    mon.detach()


# --------------------------------------------------------------------------------------------
# FSDP2: DTensor gradients, clipped by torch.nn.utils.clip_grad_norm_ on two ranks
# --------------------------------------------------------------------------------------------


def _fsdp_worker(rank, port, out):
    from test_fsdp import _batches, _half, _join, _leave, _quiet, _sharded

    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    stats = []
    for batch in _batches(3):
        x, y = _half(batch, rank)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
        stats.append(mon.stats)
    mon.detach()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    torch.save({"stats": stats, "params": full}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


@needs_fsdp2_on_cpu
def test_fsdp2_statistics_are_of_the_unclipped_gradients_over_every_shard(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    from test_fsdp import _batches, _mlp, _run

    r0, r1 = _run(_fsdp_worker, tmp_path)
    model = _mlp()  # the unsharded reference on the whole batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(_batches(3)):
        nn.functional.mse_loss(model(x), y).backward()
        total = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
        assert total > 0.1  # the clip to 0.01 engaged
        for r in (r0, r1):
            assert r["stats"][i]["grad_norm/total"] == pytest.approx(total, rel=1e-5)
            assert r["stats"][i]["grad_clip/coef"] == pytest.approx(0.01 / total, rel=1e-4)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        torch.testing.assert_close(r0["params"][n], p.detach(), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# The HF Trainer clips (max_grad_norm, through accelerate) before on_pre_optimizer_step
# --------------------------------------------------------------------------------------------


def test_hf_trainer_statistics_are_its_own_unclipped_grad_norm(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from sfmonitor.integrations.transformers import SFMonitorTrainerCallback

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": t, "labels": t} for t in ids]
    cb = SFMonitorTrainerCallback(run_dir=tmp_path / "run", config=quiet())
    seen = []

    class Logged(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "grad_norm" in logs:  # the Trainer's own: clip_grad_norm_'s pre-clip total
                seen.append((float(logs["grad_norm"]), cb.monitor.stats))

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        max_grad_norm=0.05,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[cb, Logged()]).train()
    assert len(seen) == 4
    for grad_norm, stats in seen:
        assert grad_norm > 0.1  # the clip to 0.05 engaged
        assert stats["grad_norm/total"] == pytest.approx(grad_norm, rel=1e-4)
        assert stats["grad_clip/user"] == 1.0
