"""Detectors on plain numbers: fire at the right step, stay silent on long noisy healthy runs,
never let NaN or a spike into a window, round-trip their state mid-sequence."""

import copy
import itertools
import json
import math
import random

import numpy as np
import pytest

from sfmonitor import detectors as D
from sfmonitor.events import (
    ACCURACY_COLLAPSE,
    ACCURACY_DROP,
    GRAD_RATIO_IMBALANCE,
    GRAD_SPIKE,
    LOSS_RATIO_IMBALANCE,
    LOSS_SCALE_FLOOR,
    LOSS_SPIKE,
    PLATEAU,
    UPDATE_RATIO_SPIKE,
    ConfigError,
)

N_HEALTHY = 10_000


def healthy(seed, n=N_HEALTHY, start=3.0, end=0.5, noise=0.15):
    """A noisy, decreasing loss-like curve: exponential decay with lognormal noise (sigma 0.15)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    level = end + (start - end) * np.exp(-t / 2000)
    return (level * np.exp(rng.normal(0.0, noise, n))).tolist()


def run(det, key, values, spike_at=None, factor=None):
    fired = []
    for s, v in enumerate(values):
        if s == spike_at:
            v = v * factor
        for f in det.check(s, {key: v}):
            fired.append((s, f))
    return fired


# ---------------------------------------------------------------------------- loss spike


def test_loss_spike_silent_on_noisy_healthy_run_and_fires_at_spike():
    vals = healthy(0)
    assert run(D.LossSpike(), "loss/total", vals) == []
    fired = run(D.LossSpike(), "loss/total", vals, spike_at=7000, factor=10.0)
    assert [s for s, _ in fired] == [7000]
    f = fired[0][1]
    assert f.kind == LOSS_SPIKE and f.where == "total" and f.before_update
    assert f.data["value"] == pytest.approx(vals[7000] * 10)
    assert f.data["z"] > f.data["z_threshold"] == 6.0
    assert f.data["threshold_value"] < f.data["value"]
    assert "sigma" in f.message and f"{f.data['value']:.4g}" in f.message


def test_loss_spike_per_component_names_the_component():
    det = D.LossSpike()
    a, b = healthy(1, 300), healthy(2, 300)
    fired = []
    for s in range(300):
        stats = {"loss/total": 0.5 * (a[s] + b[s]), "loss/vision": a[s], "loss/fusion": b[s] * (20 if s == 250 else 1)}
        fired += [(s, f.where) for f in det.check(s, stats)]
    assert (250, "fusion") in fired
    assert all(s == 250 for s, _ in fired)


def test_loss_spike_components_off_watches_total_only():
    det = D.LossSpike(D.LossSpikeConfig(components=False))
    for s in range(100):
        det.check(s, {"loss/total": 1.0 + 0.01 * (s % 3), "loss/vision": 1.0})
    assert det.check(100, {"loss/total": 1.0, "loss/vision": 100.0}) == []
    assert set(det.windows) == {"loss/total"}


def test_nan_and_inf_never_enter_the_loss_window():
    det = D.LossSpike()
    vals = healthy(3, 200)
    for s, v in enumerate(vals):
        if s % 10 == 5:
            v = float("nan") if s % 20 == 5 else float("inf")
        assert det.check(s, {"loss/total": v}) == []
    w = list(det.windows["loss/total"])
    assert all(math.isfinite(x) for x in w)
    assert len(w) == 128  # maxlen, filled with finite values only
    # a non-positive loss is ignored too (log undefined)
    det.check(201, {"loss/total": 0.0})
    assert all(math.isfinite(x) for x in det.windows["loss/total"])


def test_spike_is_clamped_before_entering_the_window():
    det = D.LossSpike()
    for s in range(100):
        det.check(s, {"loss/total": 1.0 * (1.01 if s % 2 else 0.99)})
    f = det.check(100, {"loss/total": 1e6})[0]
    assert max(det.windows["loss/total"]) == pytest.approx(math.log(f.data["threshold_value"]))
    # a second identical spike still fires: the first one did not inflate the statistics
    assert det.check(101, {"loss/total": 1e6})


def test_loss_spike_warmup_then_state_round_trip_continues_identically():
    vals = healthy(4, 600)
    vals[450] *= 8
    a = D.LossSpike()
    out_a = [(s, f.data["z"]) for s, v in enumerate(vals) for f in a.check(s, {"loss/total": v})]
    b = D.LossSpike()
    for s, v in enumerate(vals[:300]):
        b.check(s, {"loss/total": v})
    c = D.LossSpike()
    c.load_state_dict(copy.deepcopy(b.state_dict()))
    out_c = [(s, f.data["z"]) for s in range(300, 600) for f in c.check(s, {"loss/total": vals[s]})]
    assert out_c == [x for x in out_a if x[0] >= 300] and [s for s, _ in out_c] == [450]


def test_loss_spike_near_the_floor_must_give_back_part_of_the_progress_and_the_start_survives_a_resume():
    """A loss that fell from 6 to 0.01: a 19x jump there is 3% of what was learnt (no spike); a
    jump to 2 gives back a third of it (a spike). A resumed detector keeps the start, even when
    its window no longer holds it."""
    rng = np.random.default_rng(0)
    vals = [6.0, 3.0, 1.5] + (0.01 * np.exp(rng.normal(0.0, 0.3, 200))).tolist()
    cfg = D.LossSpikeConfig(window=16, warmup=8)
    det = D.LossSpike(cfg)
    assert [s for s, v in enumerate(vals) for _ in det.check(s, {"loss/total": v})] == []
    resumed = D.LossSpike(cfg)
    resumed.load_state_dict(copy.deepcopy(det.state_dict()))
    for d in (det, resumed):
        assert d.check(203, {"loss/total": 0.19}) == []  # 6+ sigma in log space, a 3% setback
        assert d.check(204, {"loss/total": 2.0})  # a third of the progress: a spike
    off = D.LossSpike(D.LossSpikeConfig(window=16, warmup=8, min_setback=0.0))
    for s, v in enumerate(vals):
        off.check(s, {"loss/total": v})
    assert off.check(203, {"loss/total": 0.19})


def test_loss_spike_config_validation():
    with pytest.raises(ConfigError, match="warmup"):
        D.LossSpikeConfig(window=16, warmup=32)
    with pytest.raises(ConfigError, match="z"):
        D.DetectorsConfig.from_dict({"loss_spike": {"z": 0}})
    with pytest.raises(ConfigError, match="loss_spike.nope"):
        D.DetectorsConfig.from_dict({"loss_spike": {"nope": 1}})


# ---------------------------------------------------------------------------- grad spike


def test_grad_spike_silent_on_noisy_healthy_run_and_fires_at_spike():
    vals = healthy(5, start=8.0, end=1.0, noise=0.2)
    assert run(D.GradSpike(), "grad_norm/total", vals) == []
    fired = run(D.GradSpike(), "grad_norm/total", vals, spike_at=5000, factor=20.0)
    assert [s for s, _ in fired] == [5000]
    f = fired[0][1]
    assert f.kind == GRAD_SPIKE and f.where == "total"
    assert math.exp(f.data["mean_log"] + 6.0 * f.data["sigma_log"]) == pytest.approx(f.data["threshold_value"])
    assert f.data["value"] > f.data["threshold_value"]


def test_grad_spike_warmup_is_silent_and_nan_never_enters_ema():
    det = D.GradSpike()
    # inside warm-up nothing fires, even a huge value
    for s in range(24):
        assert det.check(s, {"grad_norm/total": 1.0}) == []
    assert det.check(24, {"grad_norm/total": 1.0}) == []  # 25th value completes the warm-up
    for s in range(25, 60):
        assert det.check(s, {"grad_norm/total": float("nan") if s % 2 else 1.0 + 0.01 * (s % 3)}) == []
    mean, var = det.ema["grad_norm/total"]
    assert math.isfinite(mean) and math.isfinite(var)
    assert det.check(60, {"grad_norm/total": 50.0})


def test_grad_spike_groups_and_round_trip():
    cfg = D.GradSpikeConfig(groups=True)
    vals = healthy(6, 400, noise=0.1)
    a, b = D.GradSpike(cfg), D.GradSpike(cfg)
    for s in range(200):
        st = {"grad_norm/total": vals[s], "grad_norm/fusion": vals[s] / 2}
        a.check(s, st)
        b.check(s, st)
    c = D.GradSpike(cfg)
    c.load_state_dict(copy.deepcopy(b.state_dict()))
    for s in range(200, 400):
        st = {"grad_norm/total": vals[s], "grad_norm/fusion": vals[s] / 2 * (30 if s == 300 else 1)}
        fa, fc = a.check(s, st), c.check(s, st)
        assert [(f.where, f.data["z"]) for f in fa] == [(f.where, f.data["z"]) for f in fc]
        assert [f.where for f in fa] == (["fusion"] if s == 300 else [])


# ---------------------------------------------------------------------------- update ratio


def test_update_ratio_spike_after_update_relative_and_ceiling():
    det = D.UpdateRatioSpike()
    assert det.after_update is True
    rng = np.random.default_rng(7)
    vals = (1e-3 * np.exp(rng.normal(0, 0.3, N_HEALTHY))).tolist()
    fired = []
    for s, v in enumerate(vals):
        st = {"update_ratio/vision": v, "update_ratio/fusion": v * (15 if s == 9000 else 1)}
        fired += [(s, f) for f in det.check(s, st)]
    assert [(s, f.where) for s, f in fired] == [(9000, "fusion")]
    f = fired[0][1]
    assert f.kind == UPDATE_RATIO_SPIKE and f.before_update is False and f.data["step"] == 9000
    assert f.data["value"] > 10 * f.data["median"]
    # the absolute ceiling fires from the first step, during the warm-up
    det2 = D.UpdateRatioSpike()
    out = det2.check(0, {"update_ratio/text": 1.5, "param_norm/text": 3.0})
    assert out and out[0].data["threshold_value"] == 1.0 and "ceiling" in out[0].message
    # NaN never enters
    det2.check(1, {"update_ratio/text": float("nan")})
    assert list(det2.windows.get("update_ratio/text", [])) == []


# ---------------------------------------------------------------------------- ratio imbalance


def test_loss_ratio_imbalance_fires_on_crossing_and_refires_and_rearms():
    det = D.LossRatioImbalance(D.RatioImbalanceConfig(pairs=[["vision", "fusion"]]))
    rng = np.random.default_rng(8)
    healthy_r = (1.2 * np.exp(rng.normal(0, 0.1, N_HEALTHY))).tolist()  # stays well under 2
    for s, r in enumerate(healthy_r):
        assert det.check(s, {"loss_ratio/vision/fusion": r}) == []
    seq = {100: 1.5, 101: 2.5, 102: 2.6, 150: 2.7, 201: 2.8, 202: 1.9, 203: 2.4, 204: 1.7, 205: 2.2}
    fired = {s: det.check(s, {"loss_ratio/vision/fusion": r}) for s, r in seq.items()}
    steps = [s for s, fs in fired.items() if fs]
    # 101 crosses; 102/150 within refire_every; 201 refires; 203 is not re-armed (1.9 >= 0.9*2); 205 is
    assert steps == [101, 201, 205]
    f = fired[101][0]
    assert f.kind == LOSS_RATIO_IMBALANCE and f.data["a"] == "vision" and f.data["b"] == "fusion"
    assert f.data["ratio"] == 2.5 and f.data["threshold"] == 2.0 and "2.5" in f.message


def test_loss_ratio_falls_back_to_component_losses():
    det = D.LossRatioImbalance(D.RatioImbalanceConfig(pairs=[["vision", "fusion"]]))
    out = det.check(0, {"loss/vision": 3.0, "loss/fusion": 1.0})
    assert out and out[0].data["ratio"] == pytest.approx((3.0 + 1e-6) / (1.0 + 1e-6))
    assert det.check(1, {"loss/vision": float("nan"), "loss/fusion": 1.0}) == []


def test_grad_ratio_imbalance_and_patience():
    det = D.GradRatioImbalance(D.RatioImbalanceConfig(pairs=[["text", "fusion"]], patience=2))
    assert det.check(0, {"grad_ratio/text/fusion": 3.0}) == []
    out = det.check(10, {"grad_ratio/text/fusion": 3.0})
    assert out and out[0].kind == GRAD_RATIO_IMBALANCE and out[0].where == "text/fusion"
    assert det.check(11, {}) == []  # key absent on steps the stats stage does not measure it
    with pytest.raises(ConfigError, match=r"pairs\[0\]"):
        D.RatioImbalanceConfig(pairs=[["a", "a"]])


# ---------------------------------------------------------------------------- loss scale floor


def test_loss_scale_floor_fires_once_and_rearms():
    det = D.LossScaleFloor()
    scales = [65536.0 / 2**k for k in range(9)]  # down to 256
    fired = [s for s, sc in enumerate(scales) if det.check(s, {"amp/loss_scale": sc})]
    assert fired == [7]  # 65536 / 2**7 = 512 == min_loss_scale
    assert det.check(9, {"amp/loss_scale": 256.0}) == []
    det.check(10, {"amp/loss_scale": 1024.0})
    out = det.check(11, {"amp/loss_scale": 512.0})
    assert out and out[0].kind == LOSS_SCALE_FLOOR and out[0].data["min_loss_scale"] == 512.0


# ---------------------------------------------------------------------------- eval detectors


def test_accuracy_collapse_only_after_clearly_above_chance():
    det = D.AccuracyCollapse()
    assert det.observe_eval(0, {"accuracy": 0.5}, chance=0.5) == []  # at chance from the start
    assert det.observe_eval(1, {"accuracy": 0.72}, chance=0.5) == []
    out = det.observe_eval(2, {"accuracy": 0.51}, chance=0.5)
    assert out and out[0].kind == ACCURACY_COLLAPSE and out[0].data["best"] == 0.72
    assert det.observe_eval(3, {"accuracy": 0.5}, chance=0.5) == []  # once per collapse
    det.observe_eval(4, {"accuracy": 0.8}, chance=0.5)
    assert det.observe_eval(5, {"accuracy": float("nan")}, chance=0.5)  # NaN accuracy is a collapse
    assert det.best == 0.8
    assert D.AccuracyCollapse().observe_eval(0, {"accuracy": 0.1}) == []  # no chance level known


def test_accuracy_at_chance_rolls_back_only_when_the_training_loss_rose_with_it():
    """A 64-example validation set's accuracy wobbled 0.50 -> 0.63 -> 0.52 on a healthy run (a
    probe's real-script loop): taken for a collapse, rolled back and the LR cut. The report reads
    accuracy back at chance as a sign of divergence; where the monitor sees the training loss it
    asks it too: a collapse also needs the median of the last losses 1.5x their median when the
    accuracy was last clearly above chance (or non-finite). Else `accuracy_drop`, an event once,
    still armed: a later reading at chance with the loss risen is the collapse. Without any
    training loss (no combine()) and for a NaN accuracy the report's rule decides alone."""

    def trained(det, losses, start=0):
        for i, v in enumerate(losses):
            assert det.check(start + i, {"loss/total": v}) == []

    det = D.AccuracyCollapse()
    trained(det, [1.0] * 30)
    assert det.observe_eval(30, {"accuracy": 0.63}, chance=0.5) == []
    trained(det, [0.9] * 30, 30)
    out = det.observe_eval(60, {"accuracy": 0.52}, chance=0.5)
    assert [f.kind for f in out] == [ACCURACY_DROP] and "training loss" in out[0].message
    assert out[0].data["train_loss_now"] == 0.9 and out[0].data["train_loss_then"] == 1.0
    assert det.observe_eval(61, {"accuracy": 0.5}, chance=0.5) == []  # told once
    again = D.AccuracyCollapse()
    again.load_state_dict(copy.deepcopy(det.state_dict()))
    for d in (det, again):  # (the state round-trips)
        trained(d, [0.9] * 5 + [float("inf")] * 15, 62)  # the run diverges: its losses non-finite
        assert [f.kind for f in d.observe_eval(82, {"accuracy": 0.5}, chance=0.5)] == [ACCURACY_COLLAPSE]

    rose = D.AccuracyCollapse()
    trained(rose, [1.0] * 30)
    rose.observe_eval(30, {"accuracy": 0.8}, chance=0.5)
    trained(rose, [2.0] * 20, 30)
    out = rose.observe_eval(50, {"accuracy": 0.5}, chance=0.5)
    assert [f.kind for f in out] == [ACCURACY_COLLAPSE] and out[0].data["train_loss_now"] == 2.0

    blind = D.AccuracyCollapse()  # no training loss seen: the report's rule
    blind.observe_eval(0, {"accuracy": 0.8}, chance=0.5)
    assert [f.kind for f in blind.observe_eval(1, {"accuracy": 0.5}, chance=0.5)] == [ACCURACY_COLLAPSE]
    nan = D.AccuracyCollapse()
    trained(nan, [1.0] * 30)
    nan.observe_eval(30, {"accuracy": 0.8}, chance=0.5)
    assert [f.kind for f in nan.observe_eval(31, {"accuracy": float("nan")}, chance=0.5)] == [ACCURACY_COLLAPSE]
    off = D.AccuracyCollapse(D.AccuracyCollapseConfig(train_loss_rise=0))
    trained(off, [1.0] * 30)
    off.observe_eval(30, {"accuracy": 0.8}, chance=0.5)
    assert [f.kind for f in off.observe_eval(31, {"accuracy": 0.5}, chance=0.5)] == [ACCURACY_COLLAPSE]


def test_plateau_drop_then_stop_and_reset_on_improvement():
    det = D.Plateau()
    losses = [1.0, 0.9, 0.95, 0.91, 0.92, 0.93, 0.94, 0.8, 0.85, 0.86, 0.87]
    out = [(i, f.data["occurrence"]) for i, v in enumerate(losses) for f in det.observe_eval(i, {"loss": v})]
    # 3 without improvement after 0.9 -> occurrence 1 at index 4; 2 more -> occurrence 2 at index 6;
    # 0.8 improves and resets; 3 more stale -> occurrence 1 again at index 10
    assert out == [(4, 1), (6, 2), (10, 1)]
    det2 = D.Plateau(D.PlateauConfig(metric="accuracy", mode="max", patience=1))
    assert det2.observe_eval(0, {"accuracy": 0.5}) == []
    f = det2.observe_eval(1, {"accuracy": float("nan")})[0]
    assert f.kind == PLATEAU and det2.best == 0.5


def test_eval_detectors_round_trip():
    a = D.Plateau()
    for i, v in enumerate([1.0, 1.1, 1.2]):
        a.observe_eval(i, {"loss": v})
    b = D.Plateau()
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert [f.data for f in a.observe_eval(3, {"loss": 1.3})] == [f.data for f in b.observe_eval(3, {"loss": 1.3})]
    c = D.AccuracyCollapse()
    c.observe_eval(0, {"accuracy": 0.9}, chance=0.1)
    d = D.AccuracyCollapse()
    d.load_state_dict(c.state_dict())
    assert d.observe_eval(1, {"accuracy": 0.1}, chance=0.1)


# ---------------------------------------------------------------------------- build


def test_build_detectors_respects_enabled_and_all_state_is_plain():
    import json

    dets = D.build_detectors()
    assert [d.kind for d in dets] == [
        LOSS_SPIKE,
        "loss_divergence",
        GRAD_SPIKE,
        UPDATE_RATIO_SPIKE,
        LOSS_RATIO_IMBALANCE,
        GRAD_RATIO_IMBALANCE,
        LOSS_SCALE_FLOOR,
        ACCURACY_COLLAPSE,
        PLATEAU,
        "vanishing_gradient",
        "stale_update",
        "dead_units",
        "adam_eps",
        "bn_var_spike",
    ]
    assert [d.after_update for d in dets].count(True) == 3
    cfg = D.DetectorsConfig.from_dict({"grad_spike": {"enabled": False}, "plateau": {"enabled": False}})
    assert GRAD_SPIKE not in [d.kind for d in D.build_detectors(cfg)]
    for s in range(40):
        for d in dets:
            d.check(
                s,
                {
                    "loss/total": 1.0 + 0.01 * (s % 5),
                    "grad_norm/total": 2.0 + 0.01 * (s % 4),
                    "update_ratio/a": 1e-3,
                    "amp/loss_scale": 1024.0,
                },
            )
    json.dumps([d.state_dict() for d in dets])  # plain numbers, lists, dicts


def test_update_ratio_ceiling_spares_groups_that_start_at_zero():
    # LoRA B / zero-initialised biases: ratio 1/k at step k while they grow from nothing
    det = D.UpdateRatioSpike()
    fired = []
    for k in range(40):
        norm = 0.0 if k == 0 else 0.01 * k
        st = {"update_ratio/lora_b": (float("inf") if k == 0 else 1.0 / k), "param_norm/lora_b": norm}
        st.update({"update_ratio/w": 0.01, "param_norm/w": 5.0})
        fired += det.check(k, st)
    assert fired == []
    # ... and the exemption survives a resume
    again = D.UpdateRatioSpike()
    again.load_state_dict(det.state_dict())
    assert again.zero_init == {"update_ratio/lora_b"}
    # a group that does not start at zero is judged by the ceiling at once
    assert det.check(40, {"update_ratio/w": 1.2, "param_norm/w": 5.0})


def test_loss_spike_prior_judges_from_the_third_step():
    det = D.LossSpike()
    # a falling early loss (as training starts) is healthy: no finding
    assert [f for s, v in enumerate([4.4, 3.9, 3.2, 3.0, 3.2, 3.5, 3.2]) for f in det.check(s, {"loss/total": v})] == []
    # a 10^4 x loss inside the warm-up (step 7 of 25) is a spike
    out = det.check(7, {"loss/total": 3.2e4})
    assert out and out[0].kind == LOSS_SPIKE and out[0].data["sigma_log"] >= 0.1  # the prior's floor
    # before prior_after values exist only a gross jump counts: 100x the largest loss so far
    fresh = D.LossSpike()
    assert fresh.check(0, {"loss/total": 1.0}) == [] and fresh.check(1, {"loss/total": 50.0}) == []
    out = fresh.check(2, {"loss/total": 1e4})
    assert out and out[0].kind == LOSS_SPIKE and "100x the largest loss so far 50" in out[0].message
    assert fresh.windows["loss/total"][-1] == math.log(50.0)  # the spike is no start


def test_loss_divergence_finds_a_loss_that_grows_over_spans_and_names_where_it_began():
    """A loss that falls, then grows 4% a step (an LR past the edge of stability): no single step is
    a spike, but the median of 20 steps grows 2.2x a span; found once it is 10x the lowest median,
    the finding naming the step where the growth began (the rollback's target)."""
    det = D.LossDivergence()
    rng = random.Random(0)
    losses = [2.0 * 0.97**s for s in range(80)] + [2.0 * 0.97**80 * 1.04 ** (s - 80) for s in range(80, 400)]
    found = []
    for step, value in enumerate(losses):
        out = det.check(step, {"loss/total": value * math.exp(0.3 * rng.gauss(0, 1))})
        found += [(step, f) for f in out]
    assert found, "a growing loss went unseen"
    at, f = found[0]
    assert f.kind == "loss_divergence" and not f.before_update and f.step == f.data["began"]
    assert 60 <= f.step <= 100 and at - f.step <= 100 and f.data["median"] >= 10 * f.data["lowest_median"]
    assert all(g >= 1.5 for g in f.data["growth"]) and "where the growth began" in f.message
    # its history starts afresh after a finding: the next comes 60 steps later at the earliest
    assert all(b - a >= 60 for (a, _), (b, _) in itertools.pairwise(found))
    # the state round-trips
    again = D.LossDivergence()
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert again.state_dict() == det.state_dict()


def test_loss_divergence_is_silent_on_noise_level_shifts_and_signed_losses():
    """Heavy batch noise (log-normal sigma 2: single batches 50x apart), a loss that jumps to a new
    level and stays (a change of data: one span of growth), a slow healthy rise (3x over 400
    steps), and a loss seen below zero (no ratio to grow by): no finding."""
    rng = random.Random(1)
    cases = {
        "noise": [math.exp(2.0 * rng.gauss(0, 1)) for _ in range(3000)],
        "jump": [0.01] * 200 + [2.0] * 300,
        "slow": [1.0 * 3 ** (s / 400) for s in range(400)],
        "signed": [-0.1] + [2.0 * 1.05**s for s in range(300)],
    }
    for name, values in cases.items():
        det = D.LossDivergence()
        assert [f for s, v in enumerate(values) for f in det.check(s, {"loss/total": v})] == [], name
    # the same jump after a fall, announced as new data, keeps no lowest from before it
    det = D.LossDivergence()
    for s in range(100):
        det.check(s, {"loss/total": 0.01})
    det.new_regime(100)
    assert det.lowest is None and not det.losses


def test_loss_divergence_near_a_loss_floor_must_give_back_part_of_the_progress():
    """A model memorising its data (random regression targets under Adam) takes its loss from ~1
    to 3.5e-6 and wobbles back up 100x to 3.5e-4: 0.03% of the progress, Adam's usual wobble at a
    floor. Found as a divergence, it was answered by a rollback and an LR drop on a healthy run. As
    a loss spike must (``loss_spike.min_setback``), a growth must give back ``min_setback`` of the
    progress since the run's start; the same growth carried on to a fifth of the start is found."""
    rng = random.Random(3)
    fall = [math.exp(math.log(3.5e-6) * s / 300) for s in range(300)]
    wobble = [3.5e-6 * 1.05 ** (s - 300) for s in range(300, 400)]  # 3.5e-6 -> 4.6e-4
    on = [wobble[-1] * 1.05 ** (s - 400) for s in range(400, 600)]  # -> 0.8
    noisy = [v * math.exp(0.2 * rng.gauss(0, 1)) for v in fall + wobble + on]
    det = D.LossDivergence()
    found = [(s, f) for s, v in enumerate(noisy) for f in det.check(s, {"loss/total": v})]
    assert found and found[0][0] >= 400, [(s, f.message) for s, f in found[:1]]
    assert found[0][1].data["median"] - found[0][1].data["lowest_median"] >= 0.05 * (1.0 - 3.5e-6) * 0.5
    # off: found while it is still a wobble at the floor
    off = D.LossDivergence(D.LossDivergenceConfig(min_setback=0.0))
    assert any(s < 400 for s, v in enumerate(noisy) for _ in off.check(s, {"loss/total": v}))
    again = D.LossDivergence()
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert again.state_dict() == det.state_dict()


def test_loss_divergence_leaves_a_growth_the_loss_weights_explain():
    """A total that grows because the user's weight of a component grows (KL annealing, an auxiliary
    loss ramped in, given to combine() with its weights) is no divergence: at today's weights the loss
    of the steps before did not grow. The same components at constant weights growing as fast are
    one (the finding is the total's, unchanged)."""
    rng = random.Random(2)

    def stats(s, weight, main, aux):
        return {
            "loss/total": main + weight * aux,
            "loss/main": main,
            "loss/aux": aux,
            "loss_weight/main": 1.0,
            "loss_weight/aux": weight,
        }

    # the auxiliary loss falls as its weight rises 1.05x a step from 1e-4: the total grows ~100x
    ramp = []
    for s in range(400):
        weight = min(1.0, 1e-4 * 1.05 ** max(0, s - 100))
        main = 0.01 * math.exp(0.2 * rng.gauss(0, 1))
        aux = (0.5 + 2.0 * 0.995**s) * math.exp(0.2 * rng.gauss(0, 1))
        ramp.append((weight, main, aux))
    det = D.LossDivergence()
    assert [f for s, (w, m, a) in enumerate(ramp) for f in det.check(s, stats(s, w, m, a))] == []
    # the totals alone, without their components, are a growth the loss cannot tell from a divergence
    alone = D.LossDivergence()
    assert [f for s, (w, m, a) in enumerate(ramp) for f in alone.check(s, {"loss/total": m + w * a})]
    # the same totals made by a component that grows at a constant weight: found as before
    const = D.LossDivergence()
    found = [f for s, (w, m, a) in enumerate(ramp) for f in const.check(s, stats(s, 1.0, m, w * a))]
    assert found and found[0].kind == "loss_divergence"
    # the state round-trips, components and weights included
    again = D.LossDivergence()
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert again.state_dict() == det.state_dict()


def test_loss_spike_judges_each_set_of_components_in_its_own_window_and_names_it():
    """Steps that carry another task's loss (another set of components given to combine()) are
    judged among themselves: a task whose loss is 10x the usual one's is no spike of it, and a
    spike of that task says which set it was judged in."""
    rng = random.Random(3)
    det = D.LossSpike()

    def stats(name, value):
        return {"loss/total": value, f"loss/{name}": value}

    found = []
    for step in range(300):
        name, level = ("b", 10.0) if step % 10 == 9 else ("a", 1.0)
        found += det.check(step, stats(name, level * math.exp(0.1 * rng.gauss(0, 1))))
    assert found == []
    assert {"loss/total", "loss/total|b"} <= set(det.windows)
    (total,) = [f for f in det.check(300, stats("b", 1e4)) if f.kind == "loss_spike"]
    assert total.data["components"] == "b" and "loss components are b" in total.message
    (total,) = [f for f in det.check(301, stats("a", 1e4)) if f.kind == "loss_spike"]
    assert "components" not in total.data


def test_a_short_batch_is_judged_widened_and_kept_out_of_what_is_usual():
    """batch_share s < 1 (the monitor gives it for a batch smaller than the usual one): the loss
    spike's sigma, the gradient spike's mean and the update ratio's relative limit widen by
    1 / sqrt(s); under half the usual size the value enters no window. The same value at a full
    batch is a spike."""
    rng = random.Random(4)
    loss, grad, upd = D.LossSpike(), D.GradSpike(), D.UpdateRatioSpike()
    for step in range(200):
        noise = math.exp(0.05 * rng.gauss(0, 1))
        assert loss.check(step, {"loss/total": noise}) == []
        assert grad.check(step, {"grad_norm/total": noise}) == []
        assert upd.check(step, {"update_ratio/g": 1e-3 * noise}) == []
    windows = (list(loss.windows["loss/total"]), dict(grad.ema), list(upd.windows["update_ratio/g"]))
    short = {"batch_share": 1 / 64}  # widened 8x
    assert loss.check(200, {"loss/total": 1.8, **short}) == []
    assert grad.check(200, {"grad_norm/total": 4.0, **short}) == []
    assert upd.check(200, {"update_ratio/g": 4e-2, **short}) == []
    assert (list(loss.windows["loss/total"]), dict(grad.ema), list(upd.windows["update_ratio/g"])) == windows
    (f,) = loss.check(201, {"loss/total": 1.8})
    assert f.kind == "loss_spike" and f.data["batch_share"] == 1.0
    assert [f.kind for f in grad.check(201, {"grad_norm/total": 4.0})] == ["grad_spike"]
    assert [f.kind for f in upd.check(201, {"update_ratio/g": 4e-2})] == ["update_ratio_spike"]


def test_loss_spike_prior_takes_few_values_for_what_they_are():
    """A healthy batch-16 regression on noisy targets (its batch losses swing ~0.35 in log): the
    fifth loss, 2.2x the median of four, is noise that four values could not show (nor can five
    such values rule out much: the prior is wide). A 10^4x jump is still a spike there."""
    det = D.LossSpike()
    noisy = [0.456, 0.683, 0.536, 0.585, 1.289]
    assert [f for s, v in enumerate(noisy) for f in det.check(s, {"loss/total": v})] == []
    out = det.check(5, {"loss/total": 5000.0})
    assert out and out[0].kind == LOSS_SPIKE


def test_grad_spike_prior_judges_inside_the_warm_up():
    det = D.GradSpike()
    healthy = [1.0, 3.0, 2.0, 5.0, 4.0, 2.5]  # early norms that move by several times: no finding
    assert [f for s, v in enumerate(healthy) for f in det.check(s, {"grad_norm/total": v})] == []
    out = det.check(6, {"grad_norm/total": 1e4})
    assert out and out[0].kind == GRAD_SPIKE and "mean of its first values" in out[0].message
    assert det.warm["grad_norm/total"][-1] < math.log(1e4)  # clamped: the spike does not enter


def test_accuracy_collapse_with_samples_needs_a_climb_beyond_the_noise():
    # 16 validation examples, chance 0.1: 4/16 right is a lucky reading, not a climb; the 1/16
    # after it is then no collapse. Three standard errors of chance: 0.1 + 3 * 0.075 = 0.325.
    noisy = [0.25, 0.0625, 0.1875, 0.0625, 0.3125, 0.0]
    det = D.AccuracyCollapse(D.AccuracyCollapseConfig(samples=16))
    assert [f for i, a in enumerate(noisy) for f in det.observe_eval(i, {"accuracy": a}, chance=0.1)] == []
    assert not det.armed
    # without the sample count the same readings are taken for a collapse
    plain = D.AccuracyCollapse()
    assert [f for i, a in enumerate(noisy) for f in plain.observe_eval(i, {"accuracy": a}, chance=0.1)]
    # a real climb and collapse is still found
    det.observe_eval(6, {"accuracy": 0.5}, chance=0.1)
    out = det.observe_eval(7, {"accuracy": 0.0625}, chance=0.1)
    assert out and out[0].kind == ACCURACY_COLLAPSE


def test_loss_spike_follows_a_falling_loss():
    # A run that learns fast: log-loss falls from 4.4 to 2.8 over 40 steps (noise 2%). The window's
    # own median and MAD lag behind the fall and took it for noise: a 2x jump (corrupted labels)
    # was 3.5 sigma. Against the recent level and the noise of successive differences it is a spike.
    rng = np.random.default_rng(3)
    det = D.LossSpike()
    losses = [4.4 * (2.8 / 4.4) ** (s / 39) * math.exp(rng.normal(0, 0.02)) for s in range(40)]
    assert [f for s, v in enumerate(losses) for f in det.check(s, {"loss/total": v})] == []
    out = det.check(40, {"loss/total": 2 * losses[-1]})
    assert out and out[0].data["z"] > 10


def test_a_component_spike_is_its_own_kind_told_not_acted_on():
    from sfmonitor.policy import Policy

    det = D.LossSpike()
    for s in range(40):
        det.check(s, {"loss/total": 2.0, "loss/fusion": 1.0 + 0.01 * (s % 3)})
    out = det.check(40, {"loss/total": 2.0, "loss/fusion": 5.0})
    assert [(f.kind, f.where) for f in out] == [("loss_component_spike", "fusion")]
    assert Policy().decide(40, out) == []  # an event, no action (policy.ladders opts in)
    out = det.check(41, {"loss/total": 20.0, "loss/fusion": 1.0})
    assert [(f.kind, f.where) for f in out] == [("loss_spike", "total")]


def test_update_ratio_spike_judges_updates_per_unit_of_lr():
    """The relative test reads update_ratio / the LR the update was made with: a schedule that
    raises the LR (a warm restart, an unfrozen layer, a warm-up's step) raises the ratio with
    it and is no spike; an update 100x its usual size at the same LR is one."""
    det = D.UpdateRatioSpike()
    for s in range(40):
        assert det.check(s, {"update_ratio/a": 1e-5 * (1 + 0.1 * (s % 3)), "update_lr/a": 1e-4}) == []
    assert det.check(40, {"update_ratio/a": 1e-3, "update_lr/a": 1e-2}) == []  # the LR went up 100x
    out = det.check(41, {"update_ratio/a": 1e-1, "update_lr/a": 1e-2})  # 100x at that LR
    assert out and out[0].data["value"] == 1e-1 and out[0].data["lr"] == 1e-2


def test_update_ratio_spike_leaves_updates_too_small_to_matter_alone():
    """A model that memorised its data: Adam's updates are ~1e-10 of the weights and wiggle 10x.
    An update under min_ratio of the weights is no spike, however far above its median."""
    det = D.UpdateRatioSpike()
    for s in range(40):
        assert det.check(s, {"update_ratio/a": 9e-11 * (1 + 0.1 * (s % 3))}) == []
    assert det.check(40, {"update_ratio/a": 1.1e-9}) == []
    assert det.check(41, {"update_ratio/a": 1e-3})  # a real jump from that floor still is one


def test_update_ratio_windows_saved_before_the_per_lr_test_start_afresh():
    """A state saved when the windows held raw ratios (no "per_lr"): read per unit of an LR of
    1e-3, every update would be 1000x its median. Those windows are dropped; the current format
    round-trips."""
    old = D.UpdateRatioSpike()
    old.load_state_dict({"windows": {"update_ratio/a": [1e-3] * 40}, "zero_init": []})
    assert old.windows == {}
    assert old.check(0, {"update_ratio/a": 1e-3, "update_lr/a": 1e-3}) == []
    det = D.UpdateRatioSpike()
    for s in range(30):
        det.check(s, {"update_ratio/a": 1e-3, "update_lr/a": 1e-3})
    again = D.UpdateRatioSpike()
    again.load_state_dict(det.state_dict())
    assert again.windows == det.windows and len(again.windows["update_ratio/a"]) == 30


def test_update_ratio_spike_is_undone_only_when_the_loss_after_it_rose():
    """A relative spike with the loss after it (the next step's) over harm_rise x the loss before
    it, or non-finite, is a spike; one that left the loss where it was is told (large_update). The
    ceiling needs no evidence; without a loss the relative test alone decides."""

    def warmed():
        det = D.UpdateRatioSpike()
        for s in range(30):
            det.check(s, {"update_ratio/a": 1e-3 * (1 + 0.1 * (s % 3)), "loss/total": 1.0})
        return det

    def kind(stats):
        out = warmed().check(30, {"update_ratio/a": 2e-2, **stats})
        return [f.kind for f in out]

    assert kind({"loss/total": 1.0, "loss_after_update": 0.9}) == ["large_update"]
    assert kind({"loss/total": 1.0, "loss_after_update": 1.49}) == ["large_update"]
    assert kind({"loss/total": 1.0, "loss_after_update": 1.6}) == [UPDATE_RATIO_SPIKE]
    assert kind({"loss/total": 1.0, "loss_after_update": float("nan")}) == [UPDATE_RATIO_SPIKE]
    assert kind({"loss/total": 1.0}) == [UPDATE_RATIO_SPIKE]  # nothing measured after it
    out = warmed().check(30, {"update_ratio/a": 2.0, "loss/total": 1.0, "loss_after_update": 0.5})
    assert [f.kind for f in out] == [UPDATE_RATIO_SPIKE]  # the ceiling
    told = warmed().check(30, {"update_ratio/a": 2e-2, "loss/total": 1.0, "loss_after_update": 0.9})[0]
    assert told.data["loss_before"] == 1.0 and told.data["loss_after"] == 0.9 and told.data["harm"] is False
    assert "no harm to undo" in told.message
    off = D.UpdateRatioSpike(D.UpdateRatioSpikeConfig(harm_rise=0))
    for s in range(30):
        off.check(s, {"update_ratio/a": 1e-3, "loss/total": 1.0})
    out = off.check(30, {"update_ratio/a": 2e-2, "loss/total": 1.0, "loss_after_update": 0.9})
    assert [f.kind for f in out] == [UPDATE_RATIO_SPIKE]


def test_an_update_at_a_one_step_lr_excursion_is_judged_at_the_schedules_lr():
    """An update made at an LR far above both the LRs before it and the next step's is judged
    against what the schedule's LR would have moved: per unit of its own LR a 100x-LR update is
    ordinary, under the ceiling, and was let through (its harm then read as bad batches). A spike
    so made is undone alone (occurrence 1: no LR drop), told with the LRs; its LR is not recorded
    as one the schedule reached. An LR that stays up is judged at its own LR, as before."""

    def warmed(**cfg):
        det = D.UpdateRatioSpike(D.UpdateRatioSpikeConfig(**cfg))
        for s in range(30):
            ratio = 1e-3 * (1 + 0.1 * (s % 3))
            assert (
                det.check(s, {"update_ratio/a": ratio, "update_lr/a": 1e-3, "next_lr/a": 1e-3, "loss/total": 1.0}) == []
            )
        return det

    bad = {"update_ratio/a": 0.1, "update_lr/a": 0.1, "next_lr/a": 1e-3, "loss/total": 1.0}
    (f,) = warmed().check(30, {**bad, "loss_after_update": 3.0})
    assert f.kind == UPDATE_RATIO_SPIKE and f.occurrence == 1
    assert f.data["lr_excursion"] == {"lr": 0.1, "schedule_lr": 1e-3, "next_lr": 1e-3, "times": pytest.approx(100)}
    assert "excursion" in f.message and "no LR drop" in f.message
    (told,) = warmed().check(30, {**bad, "loss_after_update": 0.9})  # it did no harm: told
    assert told.kind == "large_update" and "excursion" in told.message
    # the LR stays up (the next step's is as high): no excursion; a raise, judged at the LR before
    # it by what it did to the loss: harmful, a spike (the LR drop that may follow is sized to the
    # raise); harmless, the user's raise, accepted silently
    (raised,) = warmed().check(30, {**bad, "next_lr/a": 0.1, "loss_after_update": 3.0})
    assert raised.kind == UPDATE_RATIO_SPIKE and raised.occurrence is None and "a raise" in raised.message
    assert raised.data["lr_rise"] == pytest.approx(100) and "lr_excursion" not in raised.data
    assert warmed().check(30, {**bad, "next_lr/a": 0.1, "loss_after_update": 0.9}) == []
    assert warmed(lr_excursion=0).check(30, {**bad, "loss_after_update": 3.0}) == []  # off
    det = warmed()
    det.check(30, {**bad, "loss_after_update": 3.0})
    assert max(det.lrs["update_ratio/a"]) == 1e-3  # not remembered as a level of the schedule


def test_an_lr_excursion_under_a_decaying_schedule_is_judged_at_the_schedules_lr_of_its_step():
    """Under a decaying schedule (cosine), the schedule's LR of the excursion's step is that of
    its neighbours, the update before it and the next step: the highest of the last 25 updates
    was the LR of 25 steps before (a probe: "5e+03x the schedule's 0.0015" for a 1e4x excursion
    over 7.5e-4), and the update was judged against the larger update that LR would have made."""
    det = D.UpdateRatioSpike()
    for s in range(30):
        lr = 2e-3 * 0.977**s  # halves over the window
        assert det.check(s, {"update_ratio/a": lr, "update_lr/a": lr, "next_lr/a": lr * 0.977, "loss/total": 1.0}) == []
    schedule = 2e-3 * 0.977**30
    (f,) = det.check(
        30,
        {
            "update_ratio/a": 1e4 * schedule * 0.02,  # 20x what the schedule's LR would have moved
            "update_lr/a": 1e4 * schedule,
            "next_lr/a": schedule * 0.977,
            "loss/total": 1.0,
            "loss_after_update": 3.0,
        },
    )
    assert f.data["lr_excursion"]["schedule_lr"] == pytest.approx(2e-3 * 0.977**29)
    assert f.data["lr_excursion"]["times"] == pytest.approx(1e4 * 0.977)
    with pytest.raises(ConfigError, match="lr_excursion"):
        D.UpdateRatioSpikeConfig.from_dict({"lr_excursion": 1.0})


def test_update_ratio_ceiling_asks_the_loss_only_where_the_schedule_took_the_lr_back_up():
    """Past the ceiling the update is undone at once, except where the user's schedule has just
    taken the LR back up to a level it had left (a warm restart): there it is judged by the loss as
    the relative test's. A constant LR, a first step, an LR above any before it (a schedule bug, a
    fault) keep the ceiling as it was; the LR history round-trips with the detector's state."""

    def fed(lrs):
        det = D.UpdateRatioSpike()
        for s, lr in enumerate(lrs):
            assert det.check(s, {"update_ratio/a": 0.1 * lr, "update_lr/a": lr, "loss/total": 1.0}) == []
        return det

    def kinds(det, lr):
        out = det.check(99, {"update_ratio/a": 1.5, "update_lr/a": lr, "loss/total": 1.0, "loss_after_update": 1.1})
        return [f.kind for f in out]

    cosine = [0.05 * (1 + math.cos(math.pi * k / 15)) / 2 for k in range(15)]  # 0.05 down to ~5e-4
    assert kinds(fed(cosine), 0.05) == ["large_update"]  # the restart, no harm
    det = fed(cosine)
    hurt = det.check(99, {"update_ratio/a": 1.5, "update_lr/a": 0.05, "loss/total": 1.0, "loss_after_update": 2.0})
    assert [f.kind for f in hurt] == [UPDATE_RATIO_SPIKE] and "took the LR back up" in hurt[0].message
    assert kinds(fed([0.05] * 40), 0.05) == [UPDATE_RATIO_SPIKE]  # a constant LR
    assert kinds(D.UpdateRatioSpike(), 0.05) == [UPDATE_RATIO_SPIKE]  # the first step
    assert kinds(fed([0.05] * 40), 0.5) == [UPDATE_RATIO_SPIKE]  # above any LR before it
    assert kinds(fed([0.05] * 20 + [0.5] * 12), 0.5) == [UPDATE_RATIO_SPIKE]  # ... and still after it
    assert kinds(fed([0.05] * 5 + [0.01] * 30), 0.05) == ["large_update"]  # back after a long dip
    assert kinds(fed([0.05] * 5 + [0.01] * 5 + [0.05] * 30), 0.05) == [UPDATE_RATIO_SPIKE]  # the dip is past
    det = fed(cosine)
    again = D.UpdateRatioSpike()
    again.load_state_dict(copy.deepcopy(det.state_dict()))
    assert kinds(again, 0.05) == ["large_update"]


def _level_run(det, values, start=0):
    return [(start + s, f) for s, v in enumerate(values) for f in det.check(start + s, {"loss/total": v})]


def test_loss_that_jumps_and_stays_is_a_level_shift_after_shift_after_spikes():
    """shift_after spikes in a row that agree on a level (a task switch): the next value at that
    level is a loss_level_shift, and from there the new level is normal. Spikes that climb (each
    2x the last) never agree on a level; shift_after 0 never shifts."""
    rng = np.random.default_rng(3)
    before = (0.5 * np.exp(rng.normal(0, 0.05, 200))).tolist()
    after = (2.0 * np.exp(rng.normal(0, 0.05, 100))).tolist()
    det = D.LossSpike()
    assert _level_run(det, before) == []
    fired = _level_run(det, after, 200)
    assert [(s, f.kind) for s, f in fired] == [(200 + i, LOSS_SPIKE) for i in range(8)] + [(208, "loss_level_shift")]
    shift = fired[-1][1]
    assert shift.data["skipped"] == 8 and 1.8 < shift.data["level"] < 2.2 and shift.data["expected_before"] < 0.6
    # the state round-trips mid-run (the run of spikes is part of it)
    det = D.LossSpike()
    _level_run(det, before + after[:5])
    again = D.LossSpike()
    again.load_state_dict(copy.deepcopy(det.state_dict()))
    assert [(s, f.kind) for s, f in _level_run(again, after[5:], 205)][-1] == (208, "loss_level_shift")

    climbing = [0.5 * 2**k for k in range(1, 20)]
    det = D.LossSpike()
    _level_run(det, before)
    assert {f.kind for _, f in _level_run(det, climbing, 200)} == {LOSS_SPIKE}
    det = D.LossSpike(D.LossSpikeConfig(shift_after=0))
    _level_run(det, before)
    assert "loss_level_shift" not in {f.kind for _, f in _level_run(det, after, 200)}


def test_a_level_shift_that_ends_in_one_step_soon_after_is_a_return_and_a_learnt_level_is_not():
    """After a level shift of loss/total, a fall back in one step by more than half the jump, to
    nearer the old level than the new one, within ``return_within`` steps, is a loss_level_return,
    and the window from before the first jump is back (the next old-level value is no spike, a
    jump from there is). A new task learnt down to the old level step by step, a fall after
    ``return_within`` steps, and a shift to a level that came back before (alternating tasks:
    not held, ``returnable`` False) are not; return_within 0 never holds one."""
    rng = np.random.default_rng(7)
    before = (0.5 * np.exp(rng.normal(0, 0.05, 200))).tolist()
    high = (5.0 * np.exp(rng.normal(0, 0.05, 12))).tolist()

    def shifted(config=None):
        det = D.LossSpike(config)
        _level_run(det, before)
        fired = _level_run(det, high, 200)
        assert [f.kind for _, f in fired][-1] == "loss_level_shift"
        return det, fired[-1][1]

    det, shift = shifted()
    assert shift.data["returnable"]
    det = copy.deepcopy(det)
    again = D.LossSpike()  # (what awaits the shift's end is part of the state: it round-trips)
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert [(s, f.kind) for s, f in _level_run(again, [0.52], 212)] == [(212, "loss_level_return")]
    fired = _level_run(det, [0.52, 0.5, 0.49], 212)
    assert [(s, f.kind) for s, f in fired] == [(212, "loss_level_return")]
    back = fired[0][1]
    assert back.data["shift_step"] == 208 and back.data["steps_at_level"] == 4 and back.data["level_before"] < 0.6
    assert [f.kind for _, f in _level_run(det, [2.0], 215)] == [LOSS_SPIKE]  # judged by the old window

    det, _ = shifted()  # a new task learnt, down to the old level over 30 steps
    learnt = np.exp(np.linspace(np.log(5.0), np.log(0.5), 30)).tolist()
    assert "loss_level_return" not in {f.kind for _, f in _level_run(det, learnt, 212)}
    det, _ = shifted()  # the same fall, after return_within
    _level_run(det, high[:4] * 17, 212)
    assert "loss_level_return" not in {f.kind for _, f in _level_run(det, [0.5], 280)}

    det, _ = shifted()
    _level_run(det, [0.5] * 40, 212)  # (returned: the old level's window)
    again = _level_run(det, high, 252)
    assert [f.kind for _, f in again][-1] == "loss_level_shift" and not again[-1][1].data["returnable"]
    det, shift = shifted(D.LossSpikeConfig(return_within=0))
    assert not shift.data["returnable"] and det.pending == {}


def test_a_level_shift_below_the_runs_start_keeps_the_progress_made_from_it():
    """Grokking's slingshots (AdamW, mini-batches): the loss fell from ~4 to ~0.01, jumps to ~0.5
    and stays a while (a level shift), falls back, and jumps again. A level below the run's start
    has not undone the progress made from it: the next jump is judged against that start (to 0.1:
    2% of the progress, no spike), and so is the harm of an update (the loss after it 0.02 -> 0.1).
    Before, both read the start afresh from the shift's level (~0.5: 18% of "progress"), and a
    probe's grokking transformer was skipped, undone and rolled back at every slingshot until it no
    longer grokked (test accuracy 0.87 against bare 0.994)."""
    rng = np.random.default_rng(5)
    fall = np.exp(np.linspace(np.log(4.0), np.log(0.01), 200)) * np.exp(rng.normal(0, 0.05, 200))
    floor = (0.01 * np.exp(rng.normal(0, 0.05, 150))).tolist()
    slingshot = (0.5 * np.exp(rng.normal(0, 0.05, 9))).tolist()
    values = [*fall.tolist(), *floor[:60], *slingshot]
    det = D.LossSpike()
    fired = _level_run(det, values)
    assert [f.kind for _, f in fired] == [LOSS_SPIKE] * 8 + ["loss_level_shift"]
    det.new_regime(fired[-1][0])  # (as the monitor does after a level shift: the shifted key is kept)
    assert _level_run(det, floor, len(values)) == []
    assert _level_run(det, [0.1], len(values) + len(floor)) == []  # (before: a loss_spike)
    # the update-ratio detector's harm test, after the same shift (the monitor calls new_regime)
    ur = D.UpdateRatioSpike()
    after = [*fall.tolist(), *slingshot, *floor[:40]]
    for s, v in enumerate(after):
        if s == len(fall) + len(slingshot) - 1:
            ur.new_regime(s)
        ur.check(s, {"update_ratio/a": 1e-3, "loss/total": v, "loss_after_update": after[min(s + 1, len(after) - 1)]})
    big = {"update_ratio/a": 0.05, "loss/total": 0.02, "loss_after_update": 0.1}
    assert [f.kind for f in ur.check(len(after), big)] == ["large_update"]  # (before: update_ratio_spike)


def test_update_ratio_harm_near_a_loss_floor_must_give_back_progress():
    """A loss that fell from 2 to 1e-3 (SGD at convergence on imbalanced classes): the next batch
    at 10x the loss before the update is chance, 0.5% of the progress; a rise to 0.5 gives back a
    quarter of it and is harm."""

    def warmed():
        det = D.UpdateRatioSpike()
        for s in range(30):
            loss = 2.0 if s < 3 else 1e-3
            det.check(s, {"update_ratio/a": 1e-3 * (1 + 0.1 * (s % 3)), "loss/total": loss})
        return det

    def kind(after):
        out = warmed().check(30, {"update_ratio/a": 2e-2, "loss/total": 1e-3, "loss_after_update": after})
        return [f.kind for f in out]

    assert kind(1e-2) == ["large_update"]
    assert kind(0.5) == [UPDATE_RATIO_SPIKE]
    det = warmed()
    again = D.UpdateRatioSpike()
    again.load_state_dict(copy.deepcopy(det.state_dict()))
    assert again.losses_seen == [2.0, 2.0, 2.0]


def test_new_regime_forgets_the_usual_sizes_of_updates_and_gradients():
    """After a change of data (the monitor calls new_regime on a loss level shift) an update or a
    gradient 20x the old regime's is judged against the new regime's values, not the old ones."""
    ur, gs = D.UpdateRatioSpike(), D.GradSpike()
    for s in range(40):
        ur.check(s, {"update_ratio/a": 1e-3 * (1 + 0.1 * (s % 3)), "loss/total": 1.0})
        gs.check(s, {"grad_norm/total": 1.0 + 0.1 * (s % 3)})
    assert ur.check(40, {"update_ratio/a": 2e-2})  # 20x: a spike in the old regime
    assert gs.check(40, {"grad_norm/total": 1e3})
    ur.new_regime(41)
    gs.new_regime(41)
    assert ur.windows == {} and ur.losses_seen == [1.0]  # (the run's start: the new level's where higher)
    assert gs.ema == {} and gs.warm == {}
    for s in range(41, 81):
        assert ur.check(s, {"update_ratio/a": 2e-2 * (1 + 0.1 * (s % 3))}) == []
        assert gs.check(s, {"grad_norm/total": 20.0 + 2 * (s % 3)}) == []
    assert ur.check(81, {"update_ratio/a": 0.5})  # 25x the new usual: a spike again


def test_update_ratio_harm_rises_above_the_runs_batch_to_batch_noise_up_to_a_cap():
    """Losses that move ~2x from one batch to the next: a 1.8x rise after a large update is that
    noise (large_update); a 5x rise is harm (over harm_rise_max, however noisy the run)."""

    def warmed():
        det = D.UpdateRatioSpike()
        for s in range(40):
            before, after = (1.0, 2.0) if s % 2 else (2.0, 1.0)
            ratio = 1e-3 * (1 + 0.1 * (s % 3))
            assert det.check(s, {"update_ratio/a": ratio, "loss/total": before, "loss_after_update": after}) == []
        return det

    def kind(after):
        out = warmed().check(40, {"update_ratio/a": 2e-2, "loss/total": 1.0, "loss_after_update": after})
        return [f.kind for f in out]

    assert kind(1.8) == ["large_update"]
    assert kind(5.0) == [UPDATE_RATIO_SPIKE]
    assert D.UpdateRatioSpike(D.UpdateRatioSpikeConfig(harm_noise=0))._harm(
        {"loss/total": 1.0, "loss_after_update": 1.8}, True
    )["harm"]


def test_a_long_run_of_spikes_that_never_agree_keeps_a_bounded_state():
    """A loss that climbs 1.3x a step for 60 steps: every value a spike, never one level. The
    detector keeps only the last shift_after + 1 of them (and the expected value before the
    first), so its state stays small however long the climb."""
    det = D.LossSpike()
    for s in range(200):
        det.check(s, {"loss/total": 1.0 + 0.01 * (s % 3)})
    kinds = [f.kind for s in range(200, 260) for f in det.check(s, {"loss/total": 2.0 * 1.3 ** (s - 200)})]
    assert kinds == [LOSS_SPIKE] * 60
    assert len(det.run["loss/total"]) <= det.config.shift_after + 2
    assert len(det.state_dict()["run"]["loss/total"]) <= det.config.shift_after + 2


def test_update_ratio_updates_that_grew_and_did_no_harm_are_learnt_after_relearn_after():
    """A group whose updates became 20x larger and stayed so, lowering the loss (a rarely routed
    expert put to work, a model near convergence): told as large_update relearn_after (8) times in
    a row, then its window restarts from them and it is no longer told (it was on every step until
    the clamped values it fed its window moved the median: 40 here, 78 in a top-1 MoE run). A
    harmful update later, past the new usual size: still a spike.
    The run of told values round-trips through the state; relearn_after 0 tells on."""

    def run(det, steps, ratio, loss=lambda s: 1.0, start=0):
        out = []
        for s in range(start, start + steps):
            stats = {"update_ratio/a": ratio * (1 + 0.1 * (s % 3)), "loss/total": loss(s)}
            stats["loss_after_update"] = loss(s + 1)
            out += [(s, f.kind) for f in det.check(s, stats)]
        return out

    det = D.UpdateRatioSpike()
    assert run(det, 40, 1e-3) == []
    falling = lambda s: 1.0 - 0.001 * s
    half = run(det, 5, 2e-2, falling, 40)
    again = D.UpdateRatioSpike()
    again.load_state_dict(copy.deepcopy(det.state_dict()))
    told = half + run(again, 55, 2e-2, falling, 45)
    assert told == [(s, "large_update") for s in range(40, 48)]
    spike = again.check(100, {"update_ratio/a": 1.0, "loss/total": 1.0, "loss_after_update": 3.0})
    assert [f.kind for f in spike] == [UPDATE_RATIO_SPIKE]
    never = D.UpdateRatioSpike(D.UpdateRatioSpikeConfig(relearn_after=0))
    run(never, 40, 1e-3)
    assert len(run(never, 60, 2e-2, falling, 40)) == 40


def test_a_loss_component_that_takes_values_at_or_below_zero_is_not_judged_by_its_log():
    """PPO's policy loss starts near 1e-7 and is mostly negative: each later positive value was
    'over 100x the largest loss so far' (7 loss_component_spike per run). A component seen at or
    below zero has no multiplicative scale: it is no longer judged (its window dropped). A positive
    component's jump still is, and so is the total's."""
    det = D.LossSpike(D.LossSpikeConfig(components=True))
    rng = np.random.default_rng(0)
    found = []
    for s in range(200):
        policy = 1e-7 if s == 0 else float(rng.normal(-0.01, 0.01))
        value = 0.5 * float(np.exp(rng.normal(0, 0.05)))
        stats = {"loss/total": value + policy, "loss/value": value, "loss/policy": policy}
        found += [(s, f.kind, f.where) for f in det.check(s, stats)]
    assert found == []
    assert "loss/policy" not in det.windows and "loss/value" in det.windows
    out = det.check(200, {"loss/total": 50.0, "loss/value": 50.0, "loss/policy": 0.02})
    assert sorted((f.kind, f.where) for f in out) == [("loss_component_spike", "value"), (LOSS_SPIKE, "total")]
    again = D.LossSpike(D.LossSpikeConfig(components=True))
    again.load_state_dict(copy.deepcopy(det.state_dict()))
    assert again.check(201, {"loss/total": 0.5, "loss/value": 0.5, "loss/policy": 5.0}) == []


def test_a_plateau_event_says_what_the_reports_rule_would_do_not_what_was_done(tmp_path):
    """At the defaults the plateau ladder only tells, but its events read "...for 3 validations:
    drop the learning rate" and then ": stop" with no action taken, the LR unchanged and the run
    going on (a healthy 15-epoch Lightning GAN). The message says what the report's early
    stopping would do; the event's actions say what was done."""
    import torch

    import sfmonitor

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config={"console": False})
    for value in [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]:
        mon.observe_eval({"loss": value})
    told = [e for e in mon.events if e.kind == PLATEAU]
    assert [e.actions for e in told] == [[], []] and not mon.should_stop
    assert "would now drop the learning rate" in told[0].message and "would now stop" in told[1].message
    assert not told[0].message.endswith(": drop the learning rate") and not told[1].message.endswith(": stop")
    mon.detach()


def test_a_raise_is_judged_against_the_loss_before_it_only_for_a_large_setback():
    """Once a raise's first updates were accepted as the user's, a later one is judged against the
    loss's level before the raise too (a loss that climbs over several steps, each rise within the
    batch noise: a schedule bug). That judgement asks a quarter of the progress given back
    (``raise_setback``): a deliberate x30 raise on a converged CNN took its loss from 0.011 to 0.085
    (5% of the progress since its start) before recovering alone, and was undone and the LR cut
    (a helper's probe: 12x the bare run's held-out loss)."""

    def raised_run(before, after, **cfg):
        det = D.UpdateRatioSpike(D.UpdateRatioSpikeConfig(harm_noise=0, harm_rise_max=4, **cfg))
        base = {"update_lr/a": 1e-3, "next_lr/a": 1e-3}
        det.check(0, {"update_ratio/a": 1e-3, **base, "loss/total": 1.5, "loss_after_update": 1.4})
        for s in range(1, 30):
            assert det.check(s, {"update_ratio/a": 1e-3, **base, "loss/total": 0.011, "loss_after_update": 0.011}) == []
        up = {"update_lr/a": 3e-2, "next_lr/a": 3e-2}
        # the raise's first update: ordinary per unit of its LR, harmless over one step: accepted
        assert det.check(30, {"update_ratio/a": 3e-2, **up, "loss/total": 0.011, "loss_after_update": 0.015}) == []
        # (each step's own rise under harm_rise 1.5: only the level before the raise can judge it)
        return det.check(31, {"update_ratio/a": 3e-2, **up, "loss/total": before, "loss_after_update": after})

    assert raised_run(0.07, 0.09) == []  # 8x the level before the raise, 5% of the progress: the user's
    (f,) = raised_run(0.4, 0.5)  # a third of the progress given back: harm
    assert f.kind == UPDATE_RATIO_SPIKE and f.data["since_raise"] and "before the raise" in f.message
    (f,) = raised_run(0.07, 0.09, raise_setback=0.05)
    assert f.kind == UPDATE_RATIO_SPIKE
    with pytest.raises(ConfigError, match="raise_setback"):
        D.UpdateRatioSpikeConfig.from_dict({"raise_setback": 2})
