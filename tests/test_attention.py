"""Attention-logit growth (docs/forensics.md): the max logit per module and head, exact, for hand-written
attention, F.scaled_dot_product_attention and nn.MultiheadAttention; the query/key projections
found; QK-Clip; the forecast that warns before the first inf; the monitor end to end."""

from __future__ import annotations

import copy
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from _state import train
from torch import nn
from torch.utils.checkpoint import checkpoint

import sfmonitor
from sfmonitor import attention as AT
from sfmonitor.actions import ActionContext
from sfmonitor.attention import ATTENTION_LOGIT_GROWTH, QK_CLIP, AttentionConfig, find_projections
from sfmonitor.errors import ConfigError
from sfmonitor.events import ACTIVATION_OVERFLOW, Decision
from sfmonitor.registry import KINDS, action_order
from sfmonitor.watch import ActivationWatch, WatchConfig

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class HandAttention(nn.Module):
    """Separate q/k/v Linears, (B, H, T, T) logits computed inline, scaled, causal-masked."""

    def __init__(self, d=16, heads=4, fill=-math.inf, fused=False):
        super().__init__()
        self.num_heads, self.d_head, self.fill = heads, d // heads, fill
        if fused:
            self.c_attn = nn.Linear(d, 3 * d)
        else:
            self.wq, self.wk, self.wv = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.fused = fused

    def qkv(self, x):
        if self.fused:
            return self.c_attn(x).split(x.shape[-1], dim=-1)
        return self.wq(x), self.wk(x), self.wv(x)

    def heads(self, t):
        B, T, _ = t.shape
        return t.reshape(B, T, self.num_heads, self.d_head).transpose(1, 2)

    def logits(self, x):
        q, k, _ = (self.heads(t) for t in self.qkv(x))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.d_head)
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        fill = self.fill if self.fill != "min" else torch.finfo(s.dtype).min
        return s.masked_fill(~causal, fill)

    def forward(self, x):
        _, _, v = (self.heads(t) for t in self.qkv(x))
        out = self.logits(x).softmax(-1) @ v
        B, H, T, dh = out.shape
        return out.transpose(1, 2).reshape(B, T, H * dh)


class SdpaAttention(nn.Module):
    def __init__(self, d=16, heads=4, kv_heads=4, **sdpa):
        super().__init__()
        self.h, self.kvh, self.dh, self.sdpa = heads, kv_heads, d // heads, sdpa
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, kv_heads * self.dh)
        self.v_proj = nn.Linear(d, kv_heads * self.dh)

    def qk(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.h, self.dh).transpose(1, 2)
        k = self.k_proj(x).reshape(B, T, self.kvh, self.dh).transpose(1, 2)
        v = self.v_proj(x).reshape(B, T, self.kvh, self.dh).transpose(1, 2)
        return q, k, v

    def forward(self, x):
        q, k, v = self.qk(x)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kvh != self.h, **self.sdpa)
        return out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)


class Block(nn.Module):
    def __init__(self, attn, d=16):
        super().__init__()
        self.attn = attn
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        return self.mlp(x + self.attn(x))


def _measure(model, x, cfg=None, **kwargs):
    """Attach a stride-1 watch, run one forward, return the host-read stats and the watch."""
    watch = ActivationWatch(WatchConfig(stride=1, attention=cfg or AttentionConfig())).attach(model)
    watch.reset(0)
    model(x, **kwargs)
    stats = {k: float(v) for k, v in watch.pending().items()}
    return stats, watch


def _per_head(logits):
    """Direct signed max per head of (B, H, L, S) logits, masked entries (-inf/min) excluded."""
    floor = torch.finfo(logits.dtype).min
    x = logits.masked_fill(logits <= floor, -math.inf)
    return [float(x[:, h].max()) for h in range(x.shape[1])]


def _entropy(weights):
    """Direct mean softmax entropy (nats) of attention weights (..., L, S), zeros weighing nothing."""
    p = weights.detach().double()
    return float(-torch.where(p > 0, p * p.log(), torch.zeros(())).sum(-1).mean())


# --------------------------------------------------------------------------------------------
# The statistic equals a direct computation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fill", [-math.inf, "min"])
def test_hand_written_logits_exact_per_head_masks_excluded(fill):
    torch.manual_seed(0)
    model = Block(HandAttention(fill=fill))
    x = torch.randn(2, 6, 16)
    with torch.no_grad():  # make the masked (upper) entries the largest ones: they must not count
        model.attn.wk.weight.mul_(3)
    stats, watch = _measure(model, x)
    logits = model.attn.logits(x).detach()
    want = _per_head(logits)
    assert [stats[f"attn_logit_max/attn/h{h}"] for h in range(4)] == pytest.approx(want, rel=1e-6)
    assert stats["attn_logit_max/attn"] == pytest.approx(max(want), rel=1e-6)
    # an |x| max would read the fill value (-inf, or the dtype's min: 3.4e38 in fp32)
    assert all(math.isfinite(v) and abs(v) < 100 for v in want)
    assert watch.attention["attn"].spec is not None
    assert stats["attn_entropy/attn"] == pytest.approx(_entropy(logits.softmax(-1)), rel=1e-5)
    assert "attn_logit_max/mlp" not in stats and "attn_entropy/mlp" not in stats  # only attention modules
    watch.detach()


def test_entropy_is_log_of_the_keys_for_uniform_attention_and_zero_for_one_hot():
    """The mean entropy per head, a fully masked row counting as 0 (never NaN)."""
    uniform = torch.zeros(2, 3, 4, 8)
    assert AT.head_entropy(uniform).tolist() == pytest.approx([math.log(8)] * 3)
    one_hot = torch.full((1, 2, 3, 5), -math.inf)
    one_hot[..., 1] = 0.0
    one_hot[0, 1, 0] = -math.inf  # a row with every key masked
    assert AT.head_entropy(one_hot).tolist() == [0.0, 0.0]
    # (B*H, L, S) with the heads given; one value when they cannot be told apart
    assert AT.head_entropy(uniform.reshape(6, 4, 8), heads=3).tolist() == pytest.approx([math.log(8)] * 3)
    assert AT.head_entropy(uniform[0, 0]).tolist() == pytest.approx([math.log(8)])
    off = _measure(Block(HandAttention()), torch.randn(2, 6, 16), AttentionConfig(entropy=False))[0]
    assert "attn_logit_max/attn" in off and "attn_entropy/attn" not in off


def test_a_fully_masked_head_reads_minus_inf_not_the_fill_value():
    logits = torch.randn(1, 2, 3, 3)
    logits[:, 1] = torch.finfo(torch.float32).min
    heads = AT.head_maxima(logits)
    assert heads[1] == -math.inf and heads[0] == logits[:, 0].max()


@pytest.mark.parametrize(
    "case",
    [
        {},
        {"is_causal": True},
        {"scale": 0.7},
        {"mask": "bool"},
        {"mask": "float"},
        {"kv_heads": 2, "is_causal": True},
    ],
)
def test_sdpa_logits_exact(case):
    torch.manual_seed(1)
    case = dict(case)
    kv_heads = case.pop("kv_heads", 4)
    mask = case.pop("mask", None)
    T = 5
    if mask == "bool":
        case["attn_mask"] = torch.rand(T, T) > 0.3
        case["attn_mask"][:, 0] = True
    elif mask == "float":
        case["attn_mask"] = torch.randn(T, T)
    model = Block(SdpaAttention(kv_heads=kv_heads, **case))
    x = torch.randn(2, T, 16)
    stats, watch = _measure(model, x)
    q, k, _ = model.attn.qk(x)
    q, k = q.detach(), k.detach()
    if kv_heads != 4:
        k = k.repeat_interleave(4 // kv_heads, dim=1)
    s = q @ k.transpose(-1, -2) * case.get("scale", 1 / math.sqrt(4))
    if case.get("is_causal"):
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    if mask == "bool":
        s = s.masked_fill(~case["attn_mask"], -math.inf)
    elif mask == "float":
        s = s + case["attn_mask"]
    want = _per_head(s)
    assert [stats[f"attn_logit_max/attn/h{h}"] for h in range(4)] == pytest.approx(want, rel=1e-5)
    assert stats["attn_entropy/attn"] == pytest.approx(_entropy(s.softmax(-1)), rel=1e-5)
    # the output is untouched by the measurement
    watch.reset(1)  # unsampled at stride... sampled: stride 1, the same numbers
    assert torch.equal(model(x), model(x))
    watch.detach()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 12])
def test_multihead_attention_logits_exact(batch_first, kdim):
    torch.manual_seed(2)
    E, H, L, Sk, N = 16, 4, 5, 7, 3
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=kdim)
    root = nn.Module()
    root.self_attn = mha
    q = torch.randn(N, L, E)
    kv = torch.randn(N, Sk, kdim or E)
    kpm = torch.zeros(N, Sk, dtype=torch.bool)
    kpm[0, -2:] = True
    am = torch.zeros(L, Sk, dtype=torch.bool)
    am[:, 0] = True
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    watch = ActivationWatch(WatchConfig(stride=1)).attach(root)
    watch.reset(0)
    _, weights = mha(q, kv, kv, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
    stats = {k: float(v) for k, v in watch.pending().items()}
    logits = AT.mha_logits(mha, (q, kv, kv), {"key_padding_mask": kpm, "attn_mask": am})
    # our logits are what MHA softmaxed: their softmax is its attention weights
    assert torch.allclose(logits.softmax(-1), weights.detach(), atol=1e-6)
    # and by hand: project, split heads, scale, mask
    qb, kb = (q, kv) if batch_first else (q.transpose(0, 1), kv.transpose(0, 1))
    if mha._qkv_same_embed_dim:
        wq, wk = mha.in_proj_weight[:E], mha.in_proj_weight[E : 2 * E]
    else:
        wq, wk = mha.q_proj_weight, mha.k_proj_weight
    qh = F.linear(qb, wq, mha.in_proj_bias[:E]).reshape(N, L, H, E // H).transpose(1, 2)
    kh = F.linear(kb, wk, mha.in_proj_bias[E : 2 * E]).reshape(N, Sk, H, E // H).transpose(1, 2)
    s = (qh @ kh.transpose(-1, -2)).detach() / math.sqrt(E // H)
    s = s.masked_fill(am, -math.inf).masked_fill(kpm[:, None, None, :], -math.inf)
    want = _per_head(s)
    assert [stats[f"attn_logit_max/self_attn/h{h}"] for h in range(H)] == pytest.approx(want, rel=1e-5)
    assert stats["attn_entropy/self_attn"] == pytest.approx(_entropy(weights), rel=1e-5)
    watch.detach()


def test_mha_inside_transformer_encoder_layer_is_measured():
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    stats, watch = _measure(layer, torch.randn(2, 5, 16))
    assert {"attn_logit_max/self_attn", "attn_logit_max/self_attn/h0", "attn_logit_max/self_attn/h1"} <= set(stats)
    assert watch.attention["self_attn"].spec.layout == "multihead_attention"
    watch.detach()


# --------------------------------------------------------------------------------------------
# Projections found
# --------------------------------------------------------------------------------------------


def test_projections_found_for_separate_fused_mha_and_configured_layouts():
    spec, _ = find_projections(HandAttention(), "blocks.0.attn")
    assert (spec.layout, spec.q_weight, spec.k_weight, spec.heads) == (
        "separate",
        "blocks.0.attn.wq.weight",
        "blocks.0.attn.wk.weight",
        4,
    )
    assert spec.q_bias == "blocks.0.attn.wq.bias" and spec.q_rows == (0, 16) and spec.k_rows == (0, 16)
    spec, _ = find_projections(HandAttention(fused=True), "h.1.attn")
    assert (spec.layout, spec.q_weight, spec.q_rows, spec.k_rows) == (
        "fused",
        "h.1.attn.c_attn.weight",
        (0, 16),
        (16, 32),
    )
    spec, _ = find_projections(SdpaAttention(kv_heads=2), "a")
    assert (spec.q_weight, spec.k_weight, spec.heads, spec.kv_heads) == (
        "a.q_proj.weight",
        "a.k_proj.weight",
        None,
        None,
    )
    spec, how = find_projections(nn.MultiheadAttention(16, 4), "enc.self_attn")
    assert spec.q_weight == spec.k_weight == "enc.self_attn.in_proj_weight" and spec.k_rows == (16, 32)
    assert spec.heads == 4 and how == "nn.MultiheadAttention"

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.make_q, self.make_k = nn.Linear(8, 8), nn.Linear(8, 8)

    spec, why = find_projections(Odd(), "odd")
    assert spec is None and "watch.attention.projections" in why
    cfg = AttentionConfig(projections={"od*": {"q": "make_q", "k": "make_k", "heads": 2}})
    spec, how = find_projections(Odd(), "odd", cfg)
    assert how == "configured" and spec.q_weight == "odd.make_q.weight" and spec.heads == 2


def test_projection_config_is_validated():
    with pytest.raises(ConfigError, match="either both q and k, or qkv"):
        WatchConfig.from_dict({"attention": {"projections": {"x": {"q": "a"}}}}, prefix="watch.")
    with pytest.raises(ConfigError, match=r"watch.attention.projections.x: unknown key 'v'"):
        WatchConfig.from_dict({"attention": {"projections": {"x": {"qkv": "a", "v": "b"}}}}, prefix="watch.")
    with pytest.raises(ConfigError, match="heads"):
        WatchConfig.from_dict({"attention": {"projections": {"x": {"qkv": "a", "heads": 0}}}}, prefix="watch.")
    with pytest.raises(ConfigError, match="tau"):
        WatchConfig.from_dict({"attention": {"tau": 0}}, prefix="watch.")


# --------------------------------------------------------------------------------------------
# QK-Clip
# --------------------------------------------------------------------------------------------


def _clip_once(model, x, tau, optimizer_runs=True, **kw):
    """Measure, decide qk_clip on the attention finding, run the (lr 0) optimizer step."""
    watch = ActivationWatch(WatchConfig(stride=1, attention=AttentionConfig(tau=tau))).attach(model)
    watch.reset(0)
    model(x, **kw).sum().backward()
    stats = {k: float(v) for k, v in watch.pending().items()}
    (f,) = [f for f in watch.findings(0, stats) if f.kind == ATTENTION_LOGIT_GROWTH]
    watch.detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctx = ActionContext(model=model, optimizer=opt)
    ctx.skip = not optimizer_runs
    facts = AT.qk_clip(ctx, Decision(QK_CLIP, f))
    if optimizer_runs:
        opt.step()  # the clip lands after the update
    return f, facts


@pytest.mark.parametrize("fused", [False, True])
def test_qk_clip_brings_heads_over_tau_to_tau_and_leaves_the_rest_bit_identical(fused):
    torch.manual_seed(4)
    model = Block(HandAttention(fused=fused))
    with torch.no_grad():
        (model.attn.c_attn.weight if fused else model.attn.wq.weight).mul_(4)
    x = torch.randn(2, 6, 16)
    before = _per_head(model.attn.logits(x).detach())
    tau = sorted(before)[1] * 1.01  # two or three heads over tau, at least one under
    ref = copy.deepcopy(model.state_dict())
    f, facts = _clip_once(model, x, tau)
    assert facts["applied"] and facts["when"] == "after this step's update"
    assert f.data["heads_over"] == facts["heads_clipped"] == [h for h, m in enumerate(before) if m > tau]
    after = _per_head(model.attn.logits(x).detach())
    for h, (b, a) in enumerate(zip(before, after)):
        assert a == pytest.approx(min(b, tau), rel=1e-5), h
        if b <= tau:
            assert a == b  # an unclipped head is bit-identical
    assert max(after) == pytest.approx(tau, rel=1e-5)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, ref[k])}
    assert changed == (
        {"attn.c_attn.weight", "attn.c_attn.bias"}
        if fused
        else {"attn.wq.weight", "attn.wq.bias", "attn.wk.weight", "attn.wk.bias"}
    )
    if fused:  # the value rows of the fused weight are untouched
        assert torch.equal(model.attn.c_attn.weight[32:], ref["attn.c_attn.weight"][32:])
    assert facts["gamma"][facts["heads_clipped"][0]] < 1 and all(
        facts["gamma"][h] == 1.0 for h in range(4) if h not in facts["heads_clipped"]
    )


@pytest.mark.parametrize("declares", ["num_heads", "head_dim", "nothing"])
def test_qk_clip_with_grouped_keys_gives_every_head_its_own_factor(declares):
    """Four query heads share two key heads. The module names its head count, or (HF Llama) only
    its head_dim, or neither: the key heads then follow from the query heads' width (the logits
    show how many query heads there are). Each key head is scaled as one, and every query head
    gets exactly its gamma."""
    torch.manual_seed(5)
    model = Block(SdpaAttention(kv_heads=2))
    if declares == "head_dim":
        model.attn.head_dim = model.attn.dh
    with torch.no_grad():
        model.attn.q_proj.weight.mul_(3)
    x = torch.randn(2, 5, 16)

    def logits():
        q, k, _ = model.attn.qk(x)
        return (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)).detach() / 2

    before = _per_head(logits())
    tau = sorted(before)[0] * 1.01
    if declares == "num_heads":
        model.attn.num_heads = 4  # heads named by the module: the spec knows them
    spec, _ = find_projections(model.attn, "attn")
    assert (spec.heads, spec.kv_heads) == ((None, None) if declares == "nothing" else (4, 2))
    _clip_once(model, x, tau)
    assert _per_head(logits()) == pytest.approx([min(b, tau) for b in before], rel=1e-5)


def test_qk_clip_on_multihead_attention_and_now_when_the_update_is_skipped():
    torch.manual_seed(6)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight[:16].mul_(5)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = mha

        def forward(self, x):
            return self.self_attn(x, x, x, need_weights=False)[0]

    model = Wrap()
    x = torch.randn(2, 5, 16)
    before = _per_head(AT.mha_logits(mha, (x, x, x), {}))
    tau = max(before) / 2
    ref_v = mha.in_proj_weight[32:].detach().clone()
    _, facts = _clip_once(model, x, tau, optimizer_runs=False)
    assert facts["when"].startswith("now")  # the update does not land: clip at once
    after = _per_head(AT.mha_logits(mha, (x, x, x), {}))
    assert after == pytest.approx([min(b, tau) for b in before], rel=1e-5)
    assert torch.equal(mha.in_proj_weight[32:], ref_v)


def test_qk_clip_without_projections_or_with_inf_logits_says_why():
    ctx = ActionContext(model=nn.Linear(2, 2), optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    f = AT.finding(3, "odd", [150.0], 100.0, None, "no query/key projections found in 'odd'", {})
    facts = AT.qk_clip(ctx, Decision(QK_CLIP, f))
    assert facts == {"applied": False, "module": "odd", "reason": "no query/key projections found in 'odd'"}
    spec = find_projections(HandAttention(), "attn")[0]
    f = AT.finding(3, "attn", [math.inf, 50.0, 20.0, 10.0], 100.0, spec, "", {})
    facts = AT.qk_clip(ctx, Decision(QK_CLIP, f))
    assert not facts["applied"] and facts["unsized_heads"] == [0]


def test_registration_kind_ladder_and_action_order():
    assert KINDS[ATTENTION_LOGIT_GROWTH].rungs == ((1, (QK_CLIP,)),)
    rungs = dict(KINDS[ACTIVATION_OVERFLOW].rungs)
    assert rungs[2] == (QK_CLIP,) and rungs[3] == ("precision_fallback",)  # QK-Clip before the last resort
    order = action_order()
    assert order.index("lr_drop") < order.index(QK_CLIP) < order.index("precision_fallback")


# --------------------------------------------------------------------------------------------
# The forecast: warned before the first inf when a maximum grows fast
# --------------------------------------------------------------------------------------------


class Fusion(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x):
        return (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(dim=-1) @ x


class Toy(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fusion = Fusion(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.fusion(x)).float().mean()


def _first_warning_and_inf(forecast: bool, start: int):
    """Input x1.35 a step, so QK^T x1.8 a step; the watch at its default stride of 10."""
    torch.manual_seed(0)
    model = Toy()
    x = torch.randn(2, 4, 8)
    watch = ActivationWatch(WatchConfig(forecast=forecast, attention=AttentionConfig(enabled=False))).attach(model)
    first_warn = first_inf = None
    warn = None
    for step in range(60):
        watch.reset(step)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x * 1.35 ** (step - start))
        stats = {k: float(v) for k, v in watch.pending().items()}
        for f in watch.findings(step, stats):
            if first_warn is None and not f.data["nonfinite"]:
                first_warn, warn = step, f
        if first_inf is None and not torch.isfinite(out):
            first_inf = step
            break
    watch.detach()
    return first_warn, first_inf, warn


@pytest.mark.parametrize("start", [0, 3, 7])
def test_a_maximum_growing_x1_8_a_step_is_warned_before_the_first_inf(start):
    first_warn, first_inf, warn = _first_warning_and_inf(True, start)
    assert first_inf is not None and first_inf > 10
    assert first_warn is not None and first_warn < first_inf
    assert warn.data["module"] == "fusion" and warn.data["growth_per_step"] == pytest.approx(1.8, rel=0.05)
    assert warn.data["steps_to_limit"] is not None and warn.data["steps_to_limit"] <= first_inf - first_warn


def test_the_fixed_stride_alone_misses_it():
    """Why the forecast: sampled every 10 steps, the same growth is +inf before the next sample."""
    misses = 0
    for start in (0, 3, 7):
        first_warn, first_inf, _ = _first_warning_and_inf(False, start)
        misses += first_warn is None or first_warn >= first_inf
    assert misses >= 2


def test_forecast_samples_sooner_near_the_limit_and_state_round_trips():
    watch = ActivationWatch(WatchConfig(stride=10))
    watch._order, watch._dtypes = ["m"], {"m": torch.float16}
    sampled = []
    value = 8.0
    for step in range(30):
        watch.reset(step)
        if watch.sampled:
            sampled.append(step)
            watch.findings(step, {"act_absmax/m": value})
        value *= 1.5
    # stride samples at 0, 10, 20 plus the rate probe at 1; then ever closer as 65504 nears
    gaps = [b - a for a, b in itertools.pairwise(sampled)]
    assert sampled[:2] == [0, 1] and gaps[-1] == 1 and len(sampled) > 5
    sd = watch.state_dict()
    other = ActivationWatch(WatchConfig(stride=10))
    other.load_state_dict(sd)
    assert other.state_dict() == sd and sd["trends"]["act_absmax/m"]


# --------------------------------------------------------------------------------------------
# The monitor, end to end
# --------------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self, d=16, vocab=11, layers=1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(HandAttention(d)) for _ in range(layers))
        self.out = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _train(lr, steps, monitor_cfg=None, tmp_path=None, layers=1, spike_at=None):
    torch.manual_seed(0)
    model = TinyLM(layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # a scheduler wraps opt.step
    mon = None
    if monitor_cfg is not None:
        mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False, **monitor_cfg})
    g = torch.Generator().manual_seed(1)
    maxima = []
    for _ in range(steps):
        idx = torch.randint(0, 11, (4, 8), generator=g)
        logits = model(idx)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 11), idx[:, 1:].reshape(-1))
        if len(maxima) == spike_at:
            loss = loss * 1000.0
        (mon.combine({"lm": loss}) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        with torch.no_grad():
            maxima.append(max(_per_head(model.blocks[0].attn.logits(model.emb(idx)))))
    if mon is not None:
        mon.detach()
    return model, mon, maxima


def test_healthy_run_no_clip_and_bit_identical(tmp_path):
    bare, _, maxima = _train(1e-3, 30)
    watched, mon, _ = _train(1e-3, 30, {"watch": {"stride": 1}}, tmp_path)
    assert max(maxima) < 100  # healthy: far under tau
    assert not [e for e in mon.events if e.kind == ATTENTION_LOGIT_GROWTH or QK_CLIP in e.actions]
    assert not [e for e in mon.events if e.kind == "attention_entropy_collapse"]
    assert "attn_logit_max/blocks.0.attn/h3" in mon.stats and "attn_entropy/blocks.0.attn" in mon.stats
    for (n, a), (_, b) in zip(bare.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), n


def test_monitor_clips_a_growing_module_and_holds_it_near_tau(tmp_path):
    tau = 8.0
    _, _, bare = _train(0.05, 60)
    assert max(bare) > 2 * tau  # at this LR the logits grow past tau
    _, mon, clipped = _train(0.05, 60, {"watch": {"attention": {"tau": tau}}}, tmp_path)
    clips = [e for e in mon.events if QK_CLIP in e.actions]
    assert clips and clips[0].kind == ATTENTION_LOGIT_GROWTH
    res = clips[0].data["action_results"][QK_CLIP]
    assert res["applied"] and res["module"] == "blocks.0.attn" and min(res["gamma"]) < 1
    first = clips[0].step
    # after the first clip the module is sampled every step and stays near tau (one step of growth)
    assert max(clipped[first:]) < 1.5 * tau
    assert max(clipped[first:]) < max(bare[first:])
    # its clips between the steps (after an update, before a held module's forward) are the
    # monitor's own writes to the weights, not the loop's (loopwrites): no new regime
    assert not [e for e in mon.events if e.kind == "new_regime"]


def test_a_loss_spike_after_the_monitors_own_clip_is_a_bad_batch_not_a_change_of_the_model(tmp_path):
    """A loss x1000 right after QK-Clip scaled a held module's rows between the steps: the
    weights moved since the last update by more than it moved them, but the monitor made that
    write itself (``own_write``), so the jump is no change of the model the loop made: skipped."""
    for at in (30, 34):
        _, mon, _ = _train(0.1, 60, {"watch": {"attention": {"tau": 4.0}}}, tmp_path / str(at), spike_at=at)
        assert any(QK_CLIP in e.actions for e in mon.events if e.step < at)
        acted = [(e.kind, e.actions) for e in mon.events if e.step == at and e.actions]
        assert acted[:1] == [("loss_spike", ["skip_step"])], acted
        assert not [e for e in mon.events if e.kind == "new_regime"]


def test_attention_turning_one_hot_under_tau_is_told_before_the_logits_reach_it():
    """Entropy collapse (Zhai et al. 2023): a head whose queries match their own key best (W_q = W_k
    = I) with W_q and W_k growing x1.1 a step: its mean softmax entropy falls under a tenth of its
    start while its max logit is still far under tau (told once, no action, with the numbers)."""
    torch.manual_seed(0)
    model = Block(HandAttention(heads=1))
    with torch.no_grad():
        for lin in (model.attn.wq, model.attn.wk):
            lin.weight.copy_(torch.eye(16))
            lin.bias.zero_()
    watch = ActivationWatch(WatchConfig(stride=1)).attach(model)
    x = torch.randn(2, 12, 16)
    told, maxima = [], []
    for step in range(40):
        watch.reset(step)
        model(x)
        stats = {k: float(v) for k, v in watch.pending().items()}
        maxima.append(stats["attn_logit_max/attn"])
        told += [(step, f) for f in watch.findings(step, stats) if f.kind == "attention_entropy_collapse"]
        with torch.no_grad():
            model.attn.wq.weight.mul_(1.1)
            model.attn.wk.weight.mul_(1.1)
    assert len(told) == 1
    step, f = told[0]
    assert f.where == "attn" and f.data["fraction"] < 0.1 and f.data["max_logit"] < 50, f.data
    assert f.data["entropy_start"] == pytest.approx(f.data["entropy"] / f.data["fraction"])
    assert "under tau" in f.message
    # told again only after it came back over twice the floor (0.2 of its start) and fell anew
    watch._entropy_start["attn"], watch._entropy_told = 1.0, set()
    seq = [0.05, 0.05, 0.15, 0.05, 0.3, 0.05]
    told_at = [k for k, v in enumerate(seq) if watch._entropy_findings(k, {"attn_entropy/attn": v})]
    assert told_at == [0, 5]
    state = watch.state_dict()  # the start and the told module survive a resume
    again = ActivationWatch(WatchConfig(stride=1))
    again.load_state_dict(state)
    assert again._entropy_start == watch._entropy_start and again._entropy_told == {"attn"}
    watch.detach()


def test_a_forecast_step_records_only_the_modules_it_was_asked_for():
    torch.manual_seed(0)
    model = Toy()
    x = torch.randn(2, 4, 8)
    watch = ActivationWatch(WatchConfig(attention=AttentionConfig(enabled=False))).attach(model)
    every = {f"act_absmax/{n}" for n in watch.module_names} | {"internal/act_first_nonfinite"}
    partial = []
    for step in range(1, 40):
        watch.reset(step)
        with torch.autocast("cpu", dtype=torch.float16):
            model(x * 1.35 ** (step - 25))
        stats = {k: float(v) for k, v in watch.pending().items()}
        if watch.sampled and step % 10 and step > 11:  # past the rate probe after the first sample
            partial.append(set(stats))
        watch.findings(step, stats)
    # the logits (x1.8 a step) are sampled ever more often; the rest only when their own growth asks
    assert len(partial) >= 4 and all(keys < every for keys in partial)
    assert {"act_absmax/fusion", "internal/act_first_nonfinite"} in partial
    watch.detach()


def test_two_modules_clipped_in_one_step(tmp_path):
    """One post-hook per optimizer applies every clip of the step (a hook removing itself while
    the optimizer iterates over its hooks would raise)."""
    _, mon, _ = _train(0.05, 40, {"watch": {"attention": {"tau": 4.0}}}, tmp_path, layers=2)
    steps = {}
    for e in mon.events:
        if QK_CLIP in e.actions and e.data["action_results"][QK_CLIP]["applied"]:
            steps.setdefault(e.step, set()).add(e.data["module"])
    assert any(len(mods) == 2 for mods in steps.values())


def _train_peaks(lr, steps, tau=None, layers=2, batch=(16, 16), tmp_path=None, sizes=None):
    """Train TinyLM; the max logit of every training forward (same weights, same batch), and the
    step of the first qk_clip that changed W_q/W_k (None: none, or no monitor). ``sizes``: batch
    sizes taken in turn (instead of batch[0])."""
    torch.manual_seed(0)
    model = TinyLM(layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    mon = None
    if tau is not None:
        cfg = {"console": False, "watch": {"attention": {"tau": tau}}}
        mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config=cfg)
    g = torch.Generator().manual_seed(1)
    peaks, first = [], None
    for step in range(steps):
        shape = (sizes[step % len(sizes)], batch[1]) if sizes else batch
        idx = torch.randint(0, 11, shape, generator=g)
        logits = model(idx)
        with torch.no_grad():
            h, m = model.emb(idx), []
            for b in model.blocks:
                m.append(max(_per_head(b.attn.logits(h))))
                h = b(h)
        peaks.append(max(m))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 11), idx[:, 1:].reshape(-1))
        (mon.combine({"lm": loss}) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
        if mon is not None and first is None:
            if any(e.data.get("action_results", {}).get(QK_CLIP, {}).get("applied") for e in mon.events):
                first = step
    if mon is not None:
        mon.detach()
    return peaks, first, mon


def test_max_logit_stays_under_tau_after_the_first_clip(tmp_path):
    """The clip is sized from the logits the updated weights give (not those of the forward before
    the update, which one high-LR AdamW step multiplies), every held module is checked after every
    update, with headroom for the next batch: no training forward after the first clip is over tau."""
    tau = 8.0
    bare, _, _ = _train_peaks(0.1, 60)
    assert max(bare) > 1.4 * tau
    peaks, first, mon = _train_peaks(0.1, 60, tau, tmp_path=tmp_path)
    assert first is not None and first < 30
    assert max(peaks[first + 1 :]) <= tau
    results = [e.data["action_results"][QK_CLIP] for e in mon.events if QK_CLIP in e.actions]
    measured = [r for r in results if r.get("applied")]
    assert measured and all(r["measured"] == "after the update, on this step's input" for r in measured)
    assert any(e.data.get("held") for e in mon.events if e.kind == ATTENTION_LOGIT_GROWTH)


def test_a_larger_batch_after_a_clip_stays_under_tau(tmp_path):
    """Batches of 2 and 64 sequences in turn: with the same weights the 64-sequence batch's max
    logit is well above the 2-sequence one's, so a clip sized after the update on the small batch
    leaves the next forward over tau (13 for tau 8 without the check). A held module is checked
    before its forward, on that forward's own input: no training forward after the first clip
    passes tau."""
    tau = 8.0
    bare, _, _ = _train_peaks(0.1, 60, sizes=(2, 64))
    assert max(bare) > 4 * tau
    peaks, first, mon = _train_peaks(0.1, 60, tau, tmp_path=tmp_path, sizes=(2, 64))
    assert first is not None and first < 30
    assert max(peaks[first + 1 :]) <= tau
    pre = [e.data["clipped_before_forward"] for e in mon.events if e.data.get("clipped_before_forward")]
    # (clipped where the forward would pass the cap just under tau: tau less the check's margin)
    assert pre and all(p["applied"] and p["max_logit"] > p["clip_target"] > tau * 0.99 for p in pre)


def test_a_held_module_is_clipped_before_a_forward_that_would_pass_tau():
    """Only after qk_clip has reported a needed clip (a finding alone never clips): the module's
    exact logits on the forward's own input, heads over tau clipped before the forward runs; only
    W_q/W_k change; once per step (not a second forward, not a no-grad forward)."""
    torch.manual_seed(3)
    model = Block(HandAttention())
    x = torch.randn(2, 6, 16)
    tau = 2 * max(_per_head(model.attn.logits(x).detach()))
    watch = ActivationWatch(WatchConfig(stride=1, attention=AttentionConfig(tau=tau))).attach(model)
    ref = copy.deepcopy(model.state_dict())
    watch.reset(0)
    model(3 * x).sum().backward()  # logits x9: over tau, measured, nothing held yet
    found = watch.findings(0, {k: float(v) for k, v in watch.pending().items()})
    assert [f.kind for f in found] == [ATTENTION_LOGIT_GROWTH] and "clipped_before_forward" not in found[0].data
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    watch.reset(1)
    watch.clipped("attn", tau / 2, True)  # qk_clip's report after step 0's update: a clip was needed
    over = _per_head(model.attn.logits(3 * x).detach())
    model(3 * x).sum().backward()
    stats = {k: float(v) for k, v in watch.pending().items()}
    after = _per_head(model.attn.logits(3 * x).detach())
    assert stats["attn_logit_max/attn"] <= tau and max(after) <= tau
    pre = next(f for f in watch.findings(1, stats) if f.kind == ATTENTION_LOGIT_GROWTH).data["clipped_before_forward"]
    assert pre["applied"] and pre["max_logit"] == pytest.approx(max(over), rel=1e-5)
    assert pre["heads_clipped"] == [h for h, m in enumerate(over) if m > tau * (1 - 1e-3)]
    assert [a == pytest.approx(m, rel=1e-6) for a, m in zip(after, over)] == [m <= tau * (1 - 1e-3) for m in over]
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, ref[k])}
    assert changed and changed <= {"attn.wq.weight", "attn.wq.bias", "attn.wk.weight", "attn.wk.bias"}
    ref = copy.deepcopy(model.state_dict())
    model(5 * x)  # the step's second forward: not checked again
    with torch.no_grad():
        watch.reset(2)
        model(5 * x)  # not a training forward
    watch.reset(3)  # reentrant checkpointing: a no-grad forward, then a recomputation in the backward
    checkpoint(model, (5 * x).requires_grad_(), use_reentrant=True).sum().backward()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    watch.detach()


def test_the_check_before_the_forward_holds_under_bf16_autocast():
    """Under autocast the check measures the logits in bf16, as the forward computes them: it must
    not leave autocast's cached bf16 copy of the weights from before the clip for the forward to use,
    and it clips with a margin of bf16's rounding (0.1% is not enough)."""
    for seed in range(5):
        torch.manual_seed(seed)
        model = Block(HandAttention())
        x = torch.randn(2, 6, 16)
        tau = 2 * max(_per_head(model.attn.logits(x).detach()))
        watch = ActivationWatch(WatchConfig(stride=1, attention=AttentionConfig(tau=tau))).attach(model)
        watch.reset(1)
        watch.clipped("attn", tau / 2, True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(3 * x).float().sum().backward()
        stats = {k: float(v) for k, v in watch.pending().items()}
        assert stats["attn_logit_max/attn"] <= tau, seed
        watch.detach()


def test_after_a_clip_the_clip_target_keeps_a_minimum_headroom():
    """A first clip is Kimi K2's (to tau); once a clip was needed the clip after the update aims at
    least MIN_HEADROOM under tau before any ratio is learned (the next batch alone can be 1.2-2.4x
    over: docs/benchmarks.md, LR sweep), and at the median learned ratio above it: one batch far
    over the rest is the check before the forward's to clip, not every step's after the update."""
    model = Block(HandAttention())
    watch = ActivationWatch(WatchConfig(stride=1, attention=AttentionConfig(tau=10.0))).attach(model)
    watch.reset(0)
    assert watch.clip_target("attn") == 10.0
    watch.reset(1)
    watch.clipped("attn", 10.0, True)
    assert watch.clip_target("attn") == pytest.approx(10.0 / 1.5)
    watch._held["attn"].ratios = [1.2, 2.0]
    assert watch.clip_target("attn") == pytest.approx(5.0)
    watch._held["attn"].ratios = [1.2, 3.6, 1.6]  # one outlier batch: the median, 1.6
    assert watch.clip_target("attn") == pytest.approx(10.0 / 1.6)
    watch.detach()


def test_remeasure_gives_the_updated_weights_logits_on_the_kept_input(tmp_path):
    """ActivationWatch.remeasure: the max logit per head the module gives *now* on the input of its
    last sampled forward, exact; nothing else changes (training mode, other parameters)."""
    torch.manual_seed(3)
    model = Block(HandAttention())
    watch = ActivationWatch(WatchConfig(stride=1, attention=AttentionConfig(tau=0.01))).attach(model)
    x = torch.randn(2, 6, 16)
    watch.reset(0)
    model(x).sum().backward()
    stats = {k: float(v) for k, v in watch.pending().items()}
    assert [f.kind for f in watch.findings(0, stats)].count(ATTENTION_LOGIT_GROWTH) == 1
    with torch.no_grad():
        model.attn.wq.weight.mul_(3)  # "the update"
    ref = copy.deepcopy(model.state_dict())
    watch.reset(1)  # the monitor opens the next step before qk_clip runs
    after = watch.remeasure("attn")
    assert after == pytest.approx(_per_head(model.attn.logits(x).detach()), rel=1e-6)
    assert model.training and model.attn.training
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert watch.remeasure("attn") is None  # the kept input is let go once used
    watch.detach()


class _Cache:
    """Stands for a key/value cache (transformers' DynamicCache): every call appends its keys."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []


class CachedAttention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.num_heads, self.hd = heads, d // heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, past_key_values=None, use_cache=True):
        B, L, D = x.shape

        def split(t):
            return t.view(B, L, self.num_heads, self.hd).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if past_key_values is not None and use_cache:
            past_key_values.keys.append(k)
            k = torch.cat(past_key_values.keys, dim=-2)
            v = torch.cat([v] * len(past_key_values.keys), dim=-2)
        a = torch.softmax(q @ k.transpose(-1, -2) / self.hd**0.5, dim=-1)
        return (a @ v).transpose(1, 2).reshape(B, L, D)


class CachedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(4, 16), CachedAttention(), nn.Linear(16, 1)

    def forward(self, x, cache):
        return self.head(self.attn(self.inp(x), past_key_values=cache)).mean()


def test_a_module_run_again_to_measure_or_clip_never_touches_a_cache_it_was_given(tmp_path):
    """QK-Clip re-runs a module on the input of its last forward (after the update, and before
    the next forward of a held module). A key/value cache in those arguments would take the keys
    a second time: a shape error in the next use, or a silently different forward."""
    torch.manual_seed(0)
    model = CachedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {"console": False, "watch": {"stride": 1, "attention": {"tau": 0.5}}}
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        cache = _Cache()  # a fresh cache per training forward, as transformers makes one
        model(torch.randn(4, 5, 4, generator=g) * 3, cache).backward()
        assert len(cache.keys) == 1  # the forward's own keys, and nothing the monitor added
        opt.step()
        opt.zero_grad()
    assert any(e.data.get("action_results", {}).get("qk_clip", {}).get("applied") for e in mon.events)
    mon.detach()


class QKNormAttention(nn.Module):
    """Queries and keys layer-normalised after their projections (qk-layernorm, as OLMo-2 and
    the LR sweep's fix): scaling W_q or W_k cannot change the logits."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.num_heads, self.hd = heads, d // heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.q_norm, self.k_norm = nn.LayerNorm(self.hd), nn.LayerNorm(self.hd)

    def forward(self, x):
        B, T, D = x.shape

        def split(t):
            return t.view(B, T, self.num_heads, self.hd).transpose(1, 2)

        q, k, v = self.q_norm(split(self.q_proj(x))), self.k_norm(split(self.k_proj(x))), split(self.v_proj(x))
        a = torch.softmax(q @ k.transpose(-1, -2) / self.hd**0.5, dim=-1)
        return (a @ v).transpose(1, 2).reshape(B, T, D)


def _qk_norm_run(tmp_path, monitored, steps=12):
    torch.manual_seed(0)
    model = Block(QKNormAttention())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)

    def loss_of(i):
        return model(torch.randn(4, 6, 16, generator=g)).pow(2).mean()

    cfg = {"watch": {"stride": 1, "attention": {"tau": 1.5}}}
    return model, train(tmp_path, model, opt, monitored, range(steps), loss_of, config=cfg, sinks=["jsonl"])


def test_a_qk_clip_that_does_not_lower_the_logits_is_undone_and_not_tried_again(tmp_path):
    """With qk-layernorm the logits do not scale with W_q and W_k: a clip would only shrink the
    weights under the norm (raising Adam's relative steps on them) step after step. The clip is
    checked on the input it was sized on; one that did not lower the logits is put back exactly,
    and the module is reported as one QK-Clip cannot act on."""
    model, events = _qk_norm_run(tmp_path / "m", True)
    bare, _ = _qk_norm_run(tmp_path / "b", False)
    clips = [e.data["action_results"]["qk_clip"] for e in events if "qk_clip" in e.actions]
    assert clips and not any(c.get("applied") for c in clips), clips[:2]
    assert any("did not lower" in c.get("reason", "") for c in clips)
    assert len(clips) <= 2  # told once more after the check, not on each of the 12 sampled steps
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bare.state_dict().values()))
    written = [json.loads(line) for line in (tmp_path / "m" / "events.jsonl").read_text().splitlines()]
    results = [e["data"]["action_results"]["qk_clip"] for e in written if "qk_clip" in e.get("actions", [])]
    assert results and not any(r.get("measured") == "pending" for r in results)  # the file says what was done


class Conv1D(nn.Module):
    """transformers' Conv1D (GPT-2's c_attn): a linear layer whose weight is laid out (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2StyleAttention(nn.Module):
    """GPT-2's layout: a fused Conv1D c_attn, and (as Swin's window attention) an nn.Softmax child
    that the name patterns match too."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.num_heads, self.hd = heads, d // heads
        self.c_attn = Conv1D(3 * d, d)
        self.softmax = nn.Softmax(dim=-1)

    def logits(self, x):
        B, T, D = x.shape
        q, k, _ = self.c_attn(x).split(D, dim=-1)
        q, k = (t.view(B, T, self.num_heads, self.hd).transpose(1, 2) for t in (q, k))
        return q @ k.transpose(-1, -2) / self.hd**0.5

    def forward(self, x):
        B, T, D = x.shape
        v = self.c_attn(x)[..., 2 * D :].view(B, T, self.num_heads, self.hd).transpose(1, 2)
        return (self.softmax(self.logits(x)) @ v).transpose(1, 2).reshape(B, T, D)


def test_qk_clip_on_a_transposed_fused_projection_measured_past_a_softmax_child():
    """GPT-2's c_attn (Conv1D, weight (in, out)): its q and k blocks are columns. The logits
    belong to the attention module, not to its nn.Softmax child (named ...attn.softmax)."""
    torch.manual_seed(7)
    model = Block(GPT2StyleAttention())
    spec, how = find_projections(model.attn, "attn")
    assert spec is not None and spec.transposed and spec.q_rows == (0, 16) and spec.k_rows == (16, 32), how
    x = torch.randn(2, 6, 16)
    before = _per_head(model.attn.logits(x).detach())
    tau = sorted(before)[1] * 1.01
    ref = copy.deepcopy(model.state_dict())
    f, facts = _clip_once(model, x, tau)
    assert f.data["module"] == "attn" and facts["applied"]
    after = _per_head(model.attn.logits(x).detach())
    assert after == pytest.approx([min(b, tau) for b in before], rel=1e-5)
    assert torch.equal(model.attn.c_attn.weight[:, 32:], ref["attn.c_attn.weight"][:, 32:])  # values untouched


def test_a_held_modules_checks_that_clip_nothing_are_no_events(tmp_path):
    """A module held after a clip is checked after every update (and before the next forward);
    a check that clips nothing is routine, not an event: a probe's post-LN runs had 445-655 such
    lines each, one per held module and step, for a few clips. The clips that changed W_q/W_k stay
    events, in the list and in the file alike."""
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = sfmonitor.attach(
        model, opt, run_dir=tmp_path, config={"console": False, "watch": {"attention": {"tau": 4.0}}}
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(60):
        idx = torch.randint(0, 11, (4, 8), generator=g)
        loss = F.cross_entropy(model(idx)[:, :-1].reshape(-1, 11), idx[:, 1:].reshape(-1))
        mon.combine({"lm": loss}).backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    growth = [e for e in mon.events if e.kind == ATTENTION_LOGIT_GROWTH]
    assert any(e.data.get("held") and e.changed() for e in growth)  # held modules were clipped again
    assert all(e.data["heads_over"] or e.changed() or e.data.get("clipped_before_forward") for e in growth)
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    written = [e for e in lines if e["kind"] == ATTENTION_LOGIT_GROWTH]
    assert [(e["step"], e["data"]["module"]) for e in written] == [(e.step, e.data["module"]) for e in growth]
