"""Activation overflow watch and precision fallback on a toy fp16 attention (CPU autocast).

CPU autocast keeps softmax in fp16, so the unscaled q @ k^T written inline in ``Fusion.forward``
truly overflows 65504 (the report's first trap). Sizes are tiny: fp16 on CPU is slow.
"""

import math

import pytest
import torch
from torch import nn

from sfmonitor.attention import ATTENTION_LOGIT_GROWTH
from sfmonitor.events import ACTIVATION_OVERFLOW, PRECISION_FALLBACK, ConfigError
from sfmonitor.watch import ACT_ABSMAX_PREFIX, FIRST_NONFINITE_KEY, ActivationWatch, WatchConfig, precision_fallback


class Fusion(nn.Module):
    """Attention with the logits computed inline (no module of their own), unscaled."""

    def __init__(self, d=8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x):  # x: (B, T, d)
        q, k = self.q(x), self.k(x)
        att = (q @ k.transpose(-1, -2)).softmax(dim=-1)  # (B, T, T), fp16 under autocast
        return att @ x  # bounded by max|x|


class Toy(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.enc = nn.Linear(d, d)
        self.fusion = Fusion(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.fusion(self.enc(x))).float().mean()


SCALES = [2 ** (k / 2) for k in range(21)]  # inputs growing step by step: logits x2 a step


def _step(model, watch, step, x):
    watch.reset(step)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    stats = {k: float(v) for k, v in watch.pending().items()}  # the single host read
    return out, stats, watch.findings(step, stats)


def _run(model, watch, x):
    first_warn = first_inf = None
    names = {}
    for step, s in enumerate(SCALES):
        out, stats, found = _step(model, watch, step, x * s)
        for f in found:
            if f.kind != ACTIVATION_OVERFLOW:
                # the same logits pass the cap tau first (and their softmax turns one-hot)
                assert f.kind in (ATTENTION_LOGIT_GROWTH, "attention_entropy_collapse")
                continue
            if f.data["nonfinite"] and first_inf is None:
                first_inf, names["inf"] = step, f.data["module"]
            if not f.data["nonfinite"] and first_warn is None:
                first_warn, names["warn"] = step, f
        if not torch.isfinite(out) and first_inf is None:
            first_inf = step
    return first_warn, first_inf, names


def _model_and_input():
    torch.manual_seed(0)
    model = Toy()
    x = torch.randn(2, 4, 8)
    return model, x


def test_warns_before_first_inf_and_names_the_module():
    model, x = _model_and_input()
    watch = ActivationWatch(WatchConfig(stride=1)).attach(model)
    assert watch.module_names == ["enc", "fusion", "fusion.q", "fusion.k", "head"]
    first_warn, first_inf, names = _run(model, watch, x)
    assert first_inf is not None, "the toy must overflow at the largest scale"
    assert first_warn is not None and first_warn < first_inf
    warn = names["warn"]
    assert warn.data["module"] == "fusion" and warn.where == "fusion"
    assert warn.data["dtype"] == "float16" and warn.data["limit"] == 65504.0
    # logits x2 a step: the growth rate warns while the value is still under half the limit
    assert warn.data["absmax"] < 65504
    assert warn.data["absmax"] >= 0.5 * 65504 or warn.data["steps_to_limit"] <= 3
    assert warn.data["growth_per_step"] == pytest.approx(2.0, rel=0.1)
    assert names["inf"] == "fusion"  # first in forward order; head is NaN too, after it
    watch.detach()


def test_inline_logits_are_what_warns():
    """Module outputs alone (att @ x is bounded) never warn: the inline capture is the promise."""
    model, x = _model_and_input()
    watch = ActivationWatch(WatchConfig(stride=1, inline=False)).attach(model)
    first_warn, first_inf, _ = _run(model, watch, x)
    assert first_inf is not None
    assert first_warn is None or first_warn >= first_inf
    watch.detach()


def test_first_nonfinite_data_and_key():
    model, x = _model_and_input()
    watch = ActivationWatch(WatchConfig(stride=1)).attach(model)
    out, stats, found = _step(model, watch, 7, x * 1024)
    assert not torch.isfinite(out)
    assert stats[FIRST_NONFINITE_KEY] == watch._order.index("fusion")
    bad = [f for f in found if f.data["nonfinite"]]
    assert len(bad) == 1 and bad[0].data["module"] == "fusion"
    assert bad[0].data["recommend"] == PRECISION_FALLBACK
    assert "head" in bad[0].data["nonfinite_modules"]
    assert "step 7" in bad[0].message and "fusion" in bad[0].message
    watch.detach()


def test_nested_attribution_and_keys():
    model, x = _model_and_input()
    watch = ActivationWatch(WatchConfig(stride=1)).attach(model)
    _, stats, _ = _step(model, watch, 0, x * 64)
    # q/k projections are recorded under their own names; the inline logits go to `fusion`.
    assert stats[ACT_ABSMAX_PREFIX + "fusion"] > 10 * stats[ACT_ABSMAX_PREFIX + "fusion.q"]
    # the attention module's logits (the softmax input) and their entropy under their own keys
    assert set(stats) == {ACT_ABSMAX_PREFIX + n for n in watch.module_names} | {
        FIRST_NONFINITE_KEY,
        "attn_logit_max/fusion",
        "attn_entropy/fusion",
    }
    assert stats[FIRST_NONFINITE_KEY] == -1
    watch.detach()


def test_stride_and_sample_next():
    model, x = _model_and_input()
    watch = ActivationWatch(WatchConfig(stride=3)).attach(model)
    sampled = []
    for step in range(6):
        watch.reset(step)
        model(x)
        sampled.append(bool(watch.pending()))
    assert sampled == [True, False, False, True, False, False]
    watch.sample_next()
    watch.reset(7)
    model(x)
    assert watch.pending()
    watch.reset(8)
    model(x)
    assert watch.pending() == {}
    watch.detach()


def test_no_grad_forwards_are_not_recorded():
    model, x = _model_and_input()
    watch = ActivationWatch(WatchConfig(stride=1)).attach(model)
    with torch.no_grad():
        model(x)
    assert watch.pending() == {}
    watch.detach()


def test_persist_recommends_fallback_and_resets():
    model, x = _model_and_input()
    watch = ActivationWatch(WatchConfig(stride=1, persist=2)).attach(model)
    overflow = lambda found: [f for f in found if f.kind == ACTIVATION_OVERFLOW]
    scale = next(s for s in (200, 256, 300) if overflow(_step(model, watch, 0, x * s)[2]))
    watch._streak.clear()
    recs = []
    for step, s in enumerate([scale, scale, 1, scale]):
        _, _, found = _step(model, watch, step, x * s)
        f = [f for f in found if f.data["module"] == "fusion" and f.kind == ACTIVATION_OVERFLOW]
        recs.append((f[0].data["consecutive"], f[0].data["recommend"]) if f else None)
    assert recs == [(1, None), (2, PRECISION_FALLBACK), None, (1, None)]
    sd = watch.state_dict()
    other = ActivationWatch(WatchConfig(stride=1, persist=2))
    other.load_state_dict(sd)
    assert other.state_dict() == sd and sd["streak"]["fusion"] == 1
    watch.detach()


def test_exception_in_forward_leaves_no_mode_pushed():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("boom")

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fusion = Boom()

        def forward(self, x):
            return self.fusion(x)

    model = Outer()
    watch = ActivationWatch(WatchConfig(stride=1)).attach(model)
    watch.reset(0)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4))
    assert torch._C._len_torch_function_stack() == 0
    assert watch._stack == []
    watch.detach()


def test_detach_restores_original_behaviour_exactly():
    model, x = _model_and_input()
    hooks_before = [(n, dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()]
    with torch.autocast("cpu", dtype=torch.float16):
        ref = model(x * 16)
    watch = ActivationWatch(WatchConfig(stride=1)).attach(model)
    watch.reset(0)
    with torch.autocast("cpu", dtype=torch.float16):
        watched = model(x * 16)
    assert torch.equal(watched, ref)  # observing changes nothing
    watch.detach()
    assert [(n, dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()] == hooks_before
    assert torch._C._len_torch_function_stack() == 0
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(model(x * 16), ref)


def test_precision_fallback_gives_finite_outputs_and_remove_undoes_it():
    model, x = _model_and_input()
    with torch.autocast("cpu", dtype=torch.float16):
        ref_small = model(x * 4)
        assert not torch.isfinite(model(x * 1024))
    watch = ActivationWatch(WatchConfig(stride=1)).attach(model)
    handle = precision_fallback(model, "fusion")
    assert handle.active and handle.module_name == "fusion"
    for step, s in enumerate(SCALES):  # the same inputs as the overflow test
        watch.reset(step)
        with torch.autocast("cpu", dtype=torch.float16):
            fused = model.fusion(model.enc(x * s))
            out = model(x * s)
        assert torch.isfinite(out), f"scale {s}"
        assert fused.dtype == torch.float32  # not cast back to fp16, whose range overflowed
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model.fusion(model.enc(x * s).bfloat16()).dtype == torch.bfloat16  # bf16: cast back
        stats = {k: float(v) for k, v in watch.pending().items()}
        assert watch._dtypes["fusion"] == torch.float32  # the logits now live in fp32
        assert not [f for f in watch.findings(step, stats) if f.data.get("nonfinite")]
    handle.remove()
    handle.remove()  # safe twice
    assert not handle.active
    watch.detach()
    assert not model.fusion._forward_hooks and not model.fusion._forward_pre_hooks
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(model(x * 4), ref_small)
        assert not torch.isfinite(model(x * 1024))


def test_precision_fallback_without_autocast_keeps_dtype_and_gradients_flow():
    model, x = _model_and_input()
    ref = model(x)
    handle = precision_fallback(model, "fusion")
    out = model(x)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    out.backward()
    assert model.fusion.q.weight.grad is not None
    handle.remove()


def test_precision_fallback_bad_input():
    model, _ = _model_and_input()
    with pytest.raises(ValueError, match="no module named 'nope'"):
        precision_fallback(model, "nope")
    model.fusion.half()
    with pytest.raises(ValueError, match="low-precision parameters"):
        precision_fallback(model, "fusion")


def test_config_validation():
    assert WatchConfig().stride >= 1
    with pytest.raises(ConfigError, match="stride"):
        WatchConfig(stride=0)
    with pytest.raises(ConfigError, match="warn_fraction"):
        WatchConfig(warn_fraction=1.5)
    with pytest.raises(ConfigError, match=r"watch.modules\[0\]"):
        WatchConfig.from_dict({"modules": ["re:("]}, prefix="watch.")
    with pytest.raises(ConfigError, match="unknown config key watch.strid"):
        WatchConfig.from_dict({"strid": 2}, prefix="watch.")


def test_selection_by_pattern_and_class():
    model, _ = _model_and_input()
    w = ActivationWatch(WatchConfig(modules=["re:^fus"], classes=[]))
    assert w.select(model) == ["fusion", "fusion.q", "fusion.k"]
    w = ActivationWatch(WatchConfig(modules=[], classes=["Fusion"]))
    assert w.select(model) == ["fusion"]
    mha = nn.Module()
    mha.block = nn.MultiheadAttention(8, 2)
    assert "block" in ActivationWatch().select(mha)
    assert ActivationWatch(WatchConfig(enabled=False)).attach(model).attached is False


def test_class_patterns_match_a_wrapped_class_by_what_it_derives_from():
    """FSDP2's fully_shard swaps a module's class for a subclass named FSDP<name> (FSDPLinear):
    the pattern "Linear" must still select it, or the watch stops seeing every Linear layer
    under FSDP2."""

    class Mixin:  # stands for FSDPModule
        pass

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    fsdp_linear = type("FSDPLinear", (Mixin, nn.Linear), {})
    for i in (0, 2):
        model[i].__class__ = fsdp_linear
    names = ActivationWatch(WatchConfig(classes=["Linear"])).select(model)
    assert names == ["0", "2"]


class Checkpointed(nn.Module):
    """A block under activation checkpointing: torch recomputes its forward inside the backward."""

    def __init__(self, reentrant: bool, d=8):
        super().__init__()
        self.reentrant = reentrant
        self.mlp = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
        self.fusion = Fusion(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.mlp, x, use_reentrant=self.reentrant)
        return self.head(checkpoint(self.fusion, h, use_reentrant=self.reentrant)).pow(2).mean()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_trains_as_without_the_monitor_and_the_watch_sees_the_forward(tmp_path, reentrant):
    """Non-reentrant checkpointing (torch's recommended mode; Hugging Face's gradient checkpointing)
    stops the recomputation inside the backward as soon as the saved tensors exist: a watch that
    entered its mode there was left holding a mode torch had dropped, and the next step raised
    "trying to pop from empty mode stack" from optimizer.step(). Every step is sampled here; the
    watch's maxima are those of the forward, and the run ends bit-identical to the bare one."""
    import sfmonitor

    def run(monitored):
        torch.manual_seed(0)
        model = Checkpointed(reentrant)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        cfg = {"console": False, "watch": {"stride": 1}}
        mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path / str(monitored)), config=cfg) if monitored else None
        seen = []
        for step in range(4):
            x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(step)).requires_grad_()
            with torch.no_grad():
                want = float(model.fusion.q(model.mlp(x)).abs().max())  # the forward, before the update
            loss = model(x)
            (mon.combine(loss) if mon else loss).backward()
            if mon:  # nothing of an aborted recomputation left behind in the watch
                assert (mon._watch._stack, mon._watch._mode) == ([], None)
            opt.step()
            opt.zero_grad()
            if mon:
                seen.append((mon.stats[ACT_ABSMAX_PREFIX + "fusion.q"], want))
        if mon:
            mon.detach()
        return model, seen

    bare, _ = run(False)
    model, seen = run(True)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bare.state_dict().values()))
    assert torch._C._len_torch_function_stack() == 0
    assert len(seen) == 4 and all(v == pytest.approx(want, rel=1e-6) for v, want in seen)


def test_two_monitors_on_one_model_leave_no_mode_behind(tmp_path):
    """One monitor per optimizer on one model (Muon for the matrices, AdamW for the rest): both
    watches enter their mode around the same modules' forwards, interleaved. Each must take its own
    mode off torch's stack, wherever it lies: one left there slows every later torch call of the
    process (33 modes in 100 steps, bare training 10x slower after detach)."""
    import sfmonitor

    torch.manual_seed(0)
    model = Toy()
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[:2], lr=0.01), torch.optim.AdamW(params[2:], lr=1e-3)]
    cfg = {"console": False, "watch": {"stride": 1}}
    mons = [sfmonitor.attach(model, o, run_dir=str(tmp_path / str(i)), config=cfg) for i, o in enumerate(opts)]
    for _ in range(3):
        loss = model(torch.randn(2, 3, 8))
        for mon in mons:
            loss = mon.combine(loss)
        loss.backward()
        assert torch._C._len_torch_function_stack() == 0
        for o in opts:
            o.step()
            o.zero_grad()
    assert all(ACT_ABSMAX_PREFIX + "fusion.q" in mon.stats for mon in mons)
    for mon in mons:
        mon.detach()
    assert torch._C._len_torch_function_stack() == 0


class _Gram(nn.Module):
    """Parameter-free pairwise similarities: no pattern of the watch selects it."""

    def forward(self, x):
        return x @ x.transpose(-1, -2)


class _GramNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.gram = _Gram()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        s = self.gram(self.embed(x))  # overflows fp16 for large inputs: inf
        return self.head(torch.softmax(s / 1000.0, -1).mean(1))  # finite again only in fp32


def gram_run(run_dir, scales, seed=0, wrap=lambda m: m):
    """Trains ``_GramNet`` (wrapped by ``wrap``: DDP) under fp16 autocast and a GradScaler, monitored,
    one step per input scale (50: gram overflows). Returns (model, monitor, the losses)."""
    import sfmonitor

    torch.manual_seed(0)
    model = wrap(_GramNet())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=run_dir, sinks=[], config={"console": False})
    g = torch.Generator().manual_seed(seed)
    losses = []
    for scale in scales:
        x = torch.randn(8, 8, 16, generator=g) * scale
        y = torch.randint(0, 4, (8,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        losses.append(float(loss))
        scaler.scale(mon.combine(loss)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, mon, losses


def test_an_overflow_in_a_module_the_watch_does_not_select_is_found_and_falls_back(tmp_path):
    # The inf is made by a parameter-free module between two watched Linears: the watched head is
    # fed it and made nothing. The watch then records every module for the next sampled steps,
    # names the one that made it, and precision_fallback runs it in fp32 -- its output staying
    # fp32, which fp16 cannot hold -- after which the loss is finite. The extra hooks go again.
    model, mon, losses = gram_run(tmp_path, [50] * 6)
    assert "gram" not in mon._watch.module_names
    g = torch.Generator().manual_seed(1)
    (found,) = [e for e in mon.events if e.kind == "activation_overflow"]
    assert found.step == 1 and found.data["module"] == "gram" and found.data["found_by_widened_watch"]
    assert found.actions == ["precision_fallback"] and found.data["dtype"] == "float16"
    assert not math.isfinite(losses[0]) and not math.isfinite(losses[1])
    assert all(math.isfinite(v) for v in losses[2:])  # gram runs in fp32 from step 2 on
    assert not mon._watch._wide and "gram" not in mon._watch._name_of.values()  # narrowed again
    with torch.autocast("cpu", dtype=torch.float16):
        out = model.gram(model.embed(torch.randn(8, 8, 16, generator=g) * 50))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    mon.detach()
    with torch.autocast("cpu", dtype=torch.float16):  # detach() removed the fallback
        assert not torch.isfinite(model.gram(model.embed(torch.randn(8, 8, 16, generator=g) * 50))).all()


def test_an_inf_made_in_fp32_is_told_and_never_falls_back(tmp_path):
    # A watched fp32 Linear makes inf from finite inputs (weights near fp32's limit): running it in
    # fp32 changes nothing, so the finding is told (the non-finite steps are the other findings'
    # to answer), never answered with a precision fallback, however often it comes.
    import sfmonitor

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e38)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False, "watch": {"stride": 1}})
    for _ in range(4):
        mon.combine(model(torch.ones(2, 4)).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    made = [e for e in mon.events if e.kind == "activation_overflow"]
    assert made and all(e.data["module"] == "0" and e.data["dtype"] == "float32" for e in made)
    assert all(e.actions == [] and e.data["recommend"] is None for e in made)
    assert "full precision" in made[0].message
    mon.detach()


class _CausalMask(nn.Module):
    """An additive causal mask in the autocast dtype: -inf above the diagonal, on purpose."""

    def forward(self, t, ref):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else ref.dtype
        return torch.triu(torch.full((t, t), float("-inf"), dtype=dtype), 1)


class _MaskedAttention(nn.Module):
    def __init__(self, d=32, own_mask=False):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mask = _CausalMask() if own_mask else None  # selected by the name pattern *attn*

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).split(x.shape[-1], -1)
        mask = self.mask(x.shape[1], x) if mask is None else mask
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
        return self.proj(torch.softmax(s, -1) @ v), s  # the masked scores too (an aux loss, a probe)


class _MaskedLM(nn.Module):
    def __init__(self, own_mask):
        super().__init__()
        self.emb = nn.Embedding(16, 32)
        self.causal = None if own_mask else _CausalMask()  # no pattern selects it
        self.attn = _MaskedAttention(own_mask=own_mask)
        self.head = nn.Linear(32, 16)

    def forward(self, idx):
        x = self.emb(idx)
        mask = self.causal(idx.shape[1], x) if self.causal is not None else None
        return self.head(x + self.attn(x, mask)[0])


@pytest.mark.parametrize("own_mask", [False, True])
def test_a_mask_written_as_minus_inf_is_no_overflow_and_the_run_is_untouched(tmp_path, own_mask):
    # A healthy fp16 model whose mask module writes -inf on purpose (the attention returns its
    # masked scores, so a watched module holds the -inf): no module "made" an overflow, the loss is
    # finite, nothing is widened or run in fp32, and the run is bit-identical to the bare one.
    import sfmonitor

    def run(monitored):
        torch.manual_seed(0)
        model = _MaskedLM(own_mask)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        scaler = torch.amp.GradScaler("cpu")
        mon = None
        if monitored:
            mon = sfmonitor.attach(
                model, opt, scaler=scaler, run_dir=tmp_path, sinks=[], config={"console": False, "watch": {"stride": 1}}
            )
        g = torch.Generator().manual_seed(1)
        for _ in range(12):
            x = torch.randint(0, 16, (4, 9), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[:, :-1]).float()
            loss = nn.functional.cross_entropy(out.reshape(-1, 16), x[:, 1:].reshape(-1))
            scaler.scale(mon.combine(loss) if mon else loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        events = [(e.step, e.kind, e.actions) for e in mon.events] if mon else []
        wide = bool(mon._watch._wide) if mon else False
        if mon:
            mon.detach()
        return model, events, wide

    bare, _, _ = run(False)
    model, events, wide = run(True)
    assert not [e for e in events if e[2]] and not [e for e in events if e[1] == "activation_overflow"], events
    assert not wide
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bare.parameters()))


def test_warnings_count_per_module():
    # The ladder's occurrence of a warning is the module's own count in the last WARN_WINDOW steps:
    # a first warning on one module is a first, whatever another module did just before (a real
    # overflow there took the kind to its last rung: that must not run this one in fp32).
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[1].weight.copy_(10 * torch.eye(4))
    watch = ActivationWatch(WatchConfig(stride=1, forecast=False)).attach(model)
    got = []
    for step, x in enumerate([5000.0, 5000.0, 40000.0]):  # [1] warns at 5000 (50000), [0] at 40000
        watch.reset(step)
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.full((2, 4), x))
        stats = {k: float(v) for k, v in watch.pending().items()}
        got += [(step, f.where, f.occurrence, f.data["nonfinite"]) for f in watch.findings(step, stats)]
    watch.detach()
    assert got == [(0, "1", 1, False), (1, "1", 2, False), (2, "1", 3, True), (2, "0", 1, False)], got


@pytest.mark.parametrize("bad", [(0, 6), (3, 7)])
def test_an_overflow_that_comes_with_rare_batches_is_found_when_it_comes_again(tmp_path, bad):
    # The unselected module overflows on two rare batches only. At the first (step 0, sampled; or
    # step 3, which the watch does not sample: a non-finite loss with finite inputs) the watch
    # widens and records every module on every step until the overflow shows again (finite steps
    # in between do not end the search), names the module then and runs it in fp32.
    first, second = bad
    _, mon, _ = gram_run(tmp_path, [50 if step in bad else 1 for step in range(9)])
    acted = [(e.step, e.kind, e.actions) for e in mon.events if e.actions]
    assert acted == [
        (first, "nonfinite_loss", ["skip_step"]),
        (second, "nonfinite_loss", ["skip_step"]),
        (second, "activation_overflow", ["precision_fallback"]),
    ], acted
    assert not mon._watch._wide
    mon.detach()


class _InlineGramNet(_GramNet):
    """The same overflow, computed in the root's own forward: no module makes it."""

    def forward(self, x):
        h = self.embed(x)
        return self.head(torch.softmax((h @ h.transpose(-1, -2)) / 1000.0, -1).mean(1))


def test_a_search_that_finds_no_maker_ends_and_pauses(tmp_path):
    # The inf comes from code outside every module: the widened watch records every module on the
    # next step, sees the loss non-finite again with no maker, narrows, and does not widen again
    # for WIDEN_COOLDOWN steps; no module is run in fp32 for it.
    from sfmonitor.watch import WIDEN_COOLDOWN

    _, mon, _ = gram_run(tmp_path, [50] * 6, wrap=lambda m: _InlineGramNet())
    watch = mon._watch
    assert not watch._wide and watch._widen_from == 1 + WIDEN_COOLDOWN
    assert not [e for e in mon.events if "precision_fallback" in e.actions]
    mon.detach()


def test_a_search_that_timed_out_imposes_no_pause(tmp_path):
    # Overflows at steps 0, 33 and 35: the search begun at step 0 ends at step 20 without having
    # seen a non-finite step (no evidence that nothing makes it), so the non-finite step 33 starts
    # a new one, which names the module at step 35.
    from sfmonitor.watch import WIDEN_STEPS

    assert WIDEN_STEPS < 33
    _, mon, _ = gram_run(tmp_path, [50 if step in (0, 33, 35) else 1 for step in range(37)])
    acted = [(e.step, e.actions) for e in mon.events if e.kind == "activation_overflow" and e.actions]
    assert acted == [(35, ["precision_fallback"])], acted
    mon.detach()


@pytest.mark.parametrize("scale, searched", [(float("nan"), False), (50.0, True)])
def test_an_unsampled_non_finite_step_searches_only_when_its_inputs_were_finite(tmp_path, scale, searched):
    # Step 3 is not sampled (stride 10). A NaN that came with the inputs is a bad batch, no module's
    # doing: no search. An inf made inside the model: the search starts.
    _, mon, _ = gram_run(tmp_path, [1, 1, 1, scale])
    assert bool(mon._watch._wide) is searched
    mon.detach()
