"""Attention-logit growth: the max attention logit per module, and QK-Clip (docs/forensics.md).

Small Transformers trained at a high learning rate grow their attention logits until the softmax
saturates (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322: attention-logit growth; qk-layernorm removes it). Kimi K2
(arXiv 2507.20534) caps them with **QK-Clip**: after the optimizer update, every head whose max
logit S_max passed tau has W_q and W_k rescaled by sqrt(tau / S_max) each, so that its logit
returns to tau. This module measures the logits and is that action.

Measurement (on the activation watch's sampled steps, exact, as 0-d tensors until the step's single
host read). The value is the **signed** max of ``QK^T * scale`` per head, masked entries excluded:

* hand-written attention (``q @ k.transpose(-1, -2)``, a scale, a mask, ``softmax``): the input of
  every softmax over the last dim computed inside an attention module's forward. It holds the
  scale and the mask; entries filled with -inf or the dtype's min never count (a signed max
  skips them; a slice that is masked entirely reads -inf);
* ``F.scaled_dot_product_attention``: the logits recomputed in fp32 from its arguments
  (``scale``, ``attn_mask`` bool or additive, ``is_causal``, ``enable_gqa``);
* ``nn.MultiheadAttention``: the logits recomputed in fp32 from its inputs and its own
  projections (``in_proj_weight`` or ``q_proj_weight``/``k_proj_weight``, biases, ``bias_k``,
  ``attn_mask``, ``key_padding_mask``), in a forward pre-hook.

Heads: the dim -3 of 4-d logits (B, H, L, S), or (B*H, L, S) when the module says how many heads
it has (``num_heads``, ``n_heads``, ``heads``, ``n_head``, ``nhead``, ``num_attention_heads``).

Query/key projections (what QK-Clip rescales) are found for the common layouts: separate q/k
``nn.Linear`` children (``q``, ``wq``, ``q_proj``, ``query``, ``to_q``, ...), a fused qkv ``nn.Linear``
(``qkv``, ``c_attn``, ``in_proj``, ``query_key_value``, ...: q|k|v blocks of rows), and
``nn.MultiheadAttention``'s own; or named by the user (``watch.attention.projections``).

Statistic keys: ``attn_logit_max/<module>`` (max over heads) and, with more than one head,
``attn_logit_max/<module>/h<i>``; both are maxima across ranks (``stats.REDUCTIONS``).
"""

from __future__ import annotations

import fnmatch
import math
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import stats as S
from .errors import ConfigError
from .events import Decision, Event, Finding
from .integrations.distributed import world_size
from .loopwrites import own_write
from .registry import register_action, register_kind
from .schema import Section, option
from .sharding import is_sharded, scale_slice_

__all__ = [
    "ATTENTION_LOGIT_GROWTH",
    "ATTN_LOGIT_MAX_PREFIX",
    "QK_CLIP",
    "AttentionConfig",
    "QKSpec",
    "find_projections",
    "head_entropy",
    "head_maxima",
    "mha_logits",
    "qk_clip",
    "qk_clip_factors",
    "sdpa_logits",
]

ATTN_LOGIT_MAX_PREFIX = "attn_logit_max/"
# Mean softmax entropy (nats) of an attention module's rows, averaged over its heads: a module whose
# attention turns one-hot has entropy near 0 (entropy collapse, Zhai et al. 2023, arXiv 2303.06296)
ATTN_ENTROPY_PREFIX = "attn_entropy/"
ATTENTION_LOGIT_GROWTH = "attention_logit_growth"
ATTENTION_ENTROPY_COLLAPSE = "attention_entropy_collapse"
QK_CLIP = "qk_clip"

# Maxima: one rank's growing head must not be diluted by the others.
S.REDUCTIONS[ATTN_LOGIT_MAX_PREFIX] = S.Reduce.MAX
# Under a process group the watch gives it as [sum, count] over the ranks that ran the module
# (ActivationWatch.pending): summed, then made a mean after the read.
S.REDUCTIONS[ATTN_ENTROPY_PREFIX] = S.Reduce.SUM

# The activation watch of each attached model (``watch.ActivationWatch.attach``): qk_clip asks it
# for the logits the updated weights give on the sampled step's own input.
WATCHES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()

# Names of query / key / fused projections (lower case), checked on direct children.
Q_NAMES = ("q", "wq", "w_q", "q_proj", "query", "to_q", "q_lin", "linear_q", "q_linear", "query_proj")
K_NAMES = ("k", "wk", "w_k", "k_proj", "key", "to_k", "k_lin", "linear_k", "k_linear", "key_proj")
QKV_NAMES = ("qkv", "wqkv", "w_qkv", "qkv_proj", "c_attn", "to_qkv", "in_proj", "query_key_value", "qkv_linear")
HEAD_ATTRS = ("num_heads", "n_heads", "heads", "n_head", "nhead", "num_attention_heads")
HEAD_DIM_ATTRS = ("head_dim", "d_head", "head_size", "attention_head_size")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_kv_head")


@dataclass
class AttentionConfig(Section):
    """Attention-logit growth: max logit per attention module and QK-Clip (docs/forensics.md)."""

    enabled: bool = option(
        True, "record attn_logit_max/<module> on sampled steps and emit attention_logit_growth findings"
    )
    tau: float = option(
        100.0,
        "logit cap: a head whose max logit passes tau is clipped back to tau by qk_clip (Kimi K2: "
        "100); healthy logits depend on the model: a few times the peak attn_logit_max of a run you "
        "trust (docs/benchmarks.md, LR sweep: 30 for its GPT)",
        lo=0.0,
        lo_open=True,
    )
    modules: list[str] = option(
        ["*attn*", "*attention*", "*fusion*"],
        "fnmatch patterns (or 're:<regex>') on names of attention modules (nn.MultiheadAttention is always one)",
    )
    classes: list[str] = option(
        ["*Attention*", "*Attn*", "*Fusion*"], "fnmatch patterns (or 're:<regex>') on class names of attention modules"
    )
    per_head: bool = option(True, "also log attn_logit_max/<module>/h<i> per head")
    entropy: bool = option(
        True,
        "also record attn_entropy/<module> on sampled steps: the mean softmax entropy of its rows (nats), "
        "averaged over heads (entropy collapse: Zhai et al. 2023)",
    )
    entropy_collapse: float = option(
        0.1,
        "told (attention_entropy_collapse, no action) when a module's attn_entropy falls under this "
        "fraction of its first sampled value (near-uniform attention at init: log of the keys): every "
        "head of the module has turned nearly one-hot. Measured on the LR sweep's GPT: 0.83 of it at its "
        "healthy LR after 300 steps; at LR 3e-2 the first layer fell to 0.08 by step 31. Told again only "
        "after it came back over twice this. 0: off",
        lo=0,
        hi=1,
    )
    projections: dict[str, dict[str, Any]] = option(
        {},
        "module-name pattern -> {q: child, k: child} or {qkv: child}, optional heads, kv_heads "
        "(children named relative to the module); overrides the automatic search",
    )

    def validate(self) -> None:
        for key in ("modules", "classes"):
            for i, pat in enumerate(getattr(self, key)):
                if pat.startswith("re:"):
                    try:
                        re.compile(pat[3:])
                    except re.error as e:
                        raise ConfigError(f"{self._prefix}{key}[{i}]: bad regex {pat[3:]!r}: {e}") from e
        for pat, spec in self.projections.items():
            key = f"{self._prefix}projections.{pat}"
            unknown = sorted(set(spec) - {"q", "k", "qkv", "heads", "kv_heads"})
            if unknown:
                raise ConfigError(f"{key}: unknown key {unknown[0]!r}; allowed: q, k, qkv, heads, kv_heads")
            if ("qkv" in spec) == ("q" in spec or "k" in spec) or (
                "qkv" not in spec and not ("q" in spec and "k" in spec)
            ):
                raise ConfigError(f"{key}: give either both q and k, or qkv")
            for name in ("q", "k", "qkv"):
                if name in spec and not isinstance(spec[name], str):
                    raise ConfigError(f"{key}.{name}: expected a child module name, got {spec[name]!r}")
            for name in ("heads", "kv_heads"):
                if name in spec and (not isinstance(spec[name], int) or isinstance(spec[name], bool) or spec[name] < 1):
                    raise ConfigError(f"{key}.{name}: expected a positive integer, got {spec[name]!r}")


def matches(patterns: list[str], text: str) -> bool:
    for pat in patterns:
        if pat.startswith("re:"):
            if re.search(pat[3:], text):
                return True
        elif fnmatch.fnmatchcase(text.lower(), pat.lower()):
            return True
    return False


def is_attention(cfg: AttentionConfig, name: str, module: nn.Module) -> bool:
    """Whether the config makes ``module`` an attention module (its softmax inputs are logits)."""
    if isinstance(module, nn.MultiheadAttention):
        return True
    if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)) or not name:
        return False
    return matches(cfg.modules, name) or matches(cfg.classes, type(module).__name__)


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def head_maxima(logits: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """Signed max of ``logits`` (..., L, S) per head, as an fp32 vector (one entry when the heads
    cannot be told apart). Head dim: -3 of a >= 4-d tensor (B, H, L, S), or (B*H, L, S) with
    ``heads`` given. A head whose entries are all masked (-inf or the dtype's min) reads -inf."""
    x = logits.detach()
    if x.ndim >= 4 and (heads is None or x.shape[-3] == heads):
        m = x.amax(dim=(-1, -2)).reshape(-1, x.shape[-3]).amax(0)
    elif x.ndim == 3 and heads and heads > 1 and x.shape[0] % heads == 0:
        m = x.amax(dim=(-1, -2)).reshape(-1, heads).amax(0)
    else:
        m = x.amax().reshape(1)
    m = m.float()
    if x.is_floating_point():
        floor = torch.finfo(x.dtype).min
        m = torch.where(m <= floor, torch.full_like(m, -math.inf), m)
    return m


def head_entropy(logits: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """Mean entropy (nats) of ``softmax(logits)`` over the last dim, per head, as an fp32 vector
    laid out as ``head_maxima``'s. Masked entries (-inf, the dtype's min) weigh nothing; a row
    with every entry masked counts as entropy 0."""
    x = logits.detach().float()
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    # (a fully masked row: log_softmax gives NaN, p > 0 is false there, so it adds 0)
    ent = -torch.where(p > 0, p * logp, torch.zeros((), device=x.device)).sum(-1)
    if x.ndim >= 4 and (heads is None or x.shape[-3] == heads):
        return ent.mean(-1).reshape(-1, x.shape[-3]).mean(0)
    if x.ndim == 3 and heads and heads > 1 and x.shape[0] % heads == 0:
        return ent.mean(-1).reshape(-1, heads).mean(0)
    return ent.mean().reshape(1)


def sdpa_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The logits ``F.scaled_dot_product_attention`` would softmax, in fp32, masked entries -inf
    (the reference implementation in the PyTorch docs of scaled_dot_product_attention)."""
    q, k = query.detach().float(), key.detach().float()
    L, Sk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    logits = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(L, Sk, dtype=torch.bool, device=q.device).tril(diagonal=0)
        logits = logits.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, -math.inf)
        else:
            logits = logits + attn_mask.detach().float()
    return logits


def _mha_args(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
    out = dict(zip(names, args))
    out.update({k: v for k, v in kwargs.items() if k in names or k == "is_causal"})
    return out


def mha_logits(mha: nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The logits (N, H, L, S) an ``nn.MultiheadAttention`` forward with these arguments softmaxes,
    in fp32, masked entries -inf (as ``F.multi_head_attention_forward`` builds them)."""
    a = _mha_args(args, kwargs)
    query, key = a.get("query"), a.get("key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return None
    batched = query.dim() == 3
    q_in, k_in = query.detach(), key.detach()
    if not batched:
        q_in, k_in = q_in.unsqueeze(1), k_in.unsqueeze(1)
    elif mha.batch_first:
        q_in, k_in = q_in.transpose(0, 1), k_in.transpose(0, 1)  # -> (L, N, E)
    E, H = mha.embed_dim, mha.num_heads
    dh = E // H
    bias = mha.in_proj_bias
    if mha._qkv_same_embed_dim:
        w_q, w_k = mha.in_proj_weight[:E], mha.in_proj_weight[E : 2 * E]
    else:
        w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
    b_q = bias[:E] if bias is not None else None
    b_k = bias[E : 2 * E] if bias is not None else None
    q = F.linear(q_in.float(), w_q.detach().float(), None if b_q is None else b_q.detach().float())
    k = F.linear(k_in.float(), w_k.detach().float(), None if b_k is None else b_k.detach().float())
    L, N = q.shape[0], q.shape[1]
    attn_mask, kpm = a.get("attn_mask"), a.get("key_padding_mask")
    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.detach().float().expand(1, N, E)])
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
    if mha.add_zero_attn:
        k = torch.cat([k, k.new_zeros(1, N, E)])
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
    Sk = k.shape[0]
    q = q.reshape(L, N, H, dh).permute(1, 2, 0, 3)  # (N, H, L, dh)
    k = k.reshape(Sk, N, H, dh).permute(1, 2, 0, 3)  # (N, H, S, dh)
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(dh)  # (N, H, L, S)
    if attn_mask is not None:
        m = attn_mask.detach()
        m = m.reshape(N, H, L, Sk) if m.dim() == 3 else m.reshape(1, 1, L, Sk)
        logits = logits.masked_fill(m, -math.inf) if m.dtype == torch.bool else logits + m.float()
    if kpm is not None:
        m = kpm.detach().reshape(N, 1, 1, Sk)
        logits = logits.masked_fill(m, -math.inf) if m.dtype == torch.bool else logits + m.float()
    return logits


# --------------------------------------------------------------------------------------------
# Query / key projections
# --------------------------------------------------------------------------------------------


@dataclass
class QKSpec:
    """Where a module's queries and keys come from: parameter names (relative to the model) and the
    rows of each weight that hold q (or k), in head order. JSON-able through ``to_dict``."""

    q_weight: str
    k_weight: str
    q_rows: tuple[int, int]
    k_rows: tuple[int, int]
    q_bias: str | None = None
    k_bias: str | None = None
    k_extra: tuple[str, ...] = ()  # key-space parameters laid out (..., E) (MHA's bias_k)
    heads: int | None = None
    kv_heads: int | None = None
    layout: str = "separate"
    transposed: bool = False  # weights laid out (in, out): HF's Conv1D (GPT-2's c_attn); rows are columns

    def to_dict(self) -> dict[str, Any]:
        return {
            "transposed": self.transposed,
            "layout": self.layout,
            "q_weight": self.q_weight,
            "k_weight": self.k_weight,
            "q_rows": list(self.q_rows),
            "k_rows": list(self.k_rows),
            "q_bias": self.q_bias,
            "k_bias": self.k_bias,
            "k_extra": list(self.k_extra),
            "heads": self.heads,
            "kv_heads": self.kv_heads,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QKSpec:
        return cls(
            q_weight=d["q_weight"],
            k_weight=d["k_weight"],
            q_rows=tuple(d["q_rows"]),
            k_rows=tuple(d["k_rows"]),
            q_bias=d.get("q_bias"),
            k_bias=d.get("k_bias"),
            k_extra=tuple(d.get("k_extra", ())),
            heads=d.get("heads"),
            kv_heads=d.get("kv_heads"),
            layout=d.get("layout", "separate"),
            transposed=bool(d.get("transposed", False)),
        )


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def module_heads(module: nn.Module) -> int | None:
    """The head count a module declares (``num_heads``, ``heads``, ...), or None."""
    return _int_attr(module, HEAD_ATTRS)


def _out_features(m: nn.Module) -> tuple[int, bool] | None:
    """(output width, transposed) of a linear projection: an ``nn.Linear``, or a module with a 2-d
    weight laid out (in, out) and its width in ``nf`` (transformers' ``Conv1D``: GPT-2's
    ``c_attn``); None for anything else."""
    if isinstance(m, nn.Linear):
        return m.out_features, False
    w, nf = getattr(m, "weight", None), getattr(m, "nf", None)
    if isinstance(w, torch.Tensor) and w.ndim == 2 and isinstance(nf, int) and w.shape[1] == nf:
        return nf, True
    return None


def _child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for child_name, child in module.named_children():
        if child_name.lower() in names and _out_features(child) is not None:
            return child_name, child
    return None


def _prefixed(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_projections(module: nn.Module, name: str, cfg: AttentionConfig | None = None) -> tuple[QKSpec | None, str]:
    """(spec, how) of the query/key projections of ``module`` (named ``name`` in the model);
    spec None when none is found (``how`` says why)."""
    cfg = cfg or AttentionConfig()
    heads = module_heads(module)
    kv_heads = _int_attr(module, KV_HEAD_ATTRS)
    user = next((spec for pat, spec in cfg.projections.items() if matches([pat], name)), None)
    if user is not None:
        heads = user.get("heads", heads)
        kv_heads = user.get("kv_heads", kv_heads)
        try:
            if "qkv" in user:
                fused = module.get_submodule(user["qkv"])
                return _fused(fused, _prefixed(name, user["qkv"]), heads, kv_heads), "configured"
            q_mod, k_mod = module.get_submodule(user["q"]), module.get_submodule(user["k"])
        except AttributeError as e:
            return None, f"watch.attention.projections names a child {name!r} does not have ({e})"
        if _out_features(q_mod) is None or _out_features(k_mod) is None:
            return None, "watch.attention.projections must name nn.Linear (or Conv1D) children"
        return _separate(q_mod, k_mod, _prefixed(name, user["q"]), _prefixed(name, user["k"]), heads, kv_heads), (
            "configured"
        )
    if isinstance(module, nn.MultiheadAttention):
        E = module.embed_dim
        if module._qkv_same_embed_dim:
            w = _prefixed(name, "in_proj_weight")
            qw = kw = w
            q_rows, k_rows = (0, E), (E, 2 * E)
        else:
            qw, kw = _prefixed(name, "q_proj_weight"), _prefixed(name, "k_proj_weight")
            q_rows, k_rows = (0, E), (0, E)
        b = _prefixed(name, "in_proj_bias") if module.in_proj_bias is not None else None
        return (
            QKSpec(
                q_weight=qw,
                k_weight=kw,
                q_rows=q_rows,
                k_rows=k_rows,
                q_bias=b,
                k_bias=b,
                k_extra=(_prefixed(name, "bias_k"),) if module.bias_k is not None else (),
                heads=module.num_heads,
                kv_heads=module.num_heads,
                layout="multihead_attention",
            ),
            "nn.MultiheadAttention",
        )
    q, k = _child(module, Q_NAMES), _child(module, K_NAMES)
    head_dim = _int_attr(module, HEAD_DIM_ATTRS)  # Llama-style modules declare this, not a count
    if q is not None and k is not None:
        q_out, k_out = _out_features(q[1])[0], _out_features(k[1])[0]  # type: ignore[index]
        if head_dim and not heads and q_out % head_dim == 0:
            heads = q_out // head_dim
        if head_dim and not kv_heads and k_out % head_dim == 0:
            kv_heads = k_out // head_dim
        return _separate(q[1], k[1], _prefixed(name, q[0]), _prefixed(name, k[0]), heads, kv_heads), (
            f"children {q[0]!r}, {k[0]!r}"
        )
    qkv = _child(module, QKV_NAMES)
    if qkv is not None:
        spec = _fused(qkv[1], _prefixed(name, qkv[0]), heads, kv_heads)
        if spec is not None:
            return spec, f"fused child {qkv[0]!r}"
    return None, (
        f"no query/key projections found in {name!r} (looked for nn.Linear children named "
        f"{'/'.join(Q_NAMES[:4])}..., {'/'.join(K_NAMES[:4])}..., {'/'.join(QKV_NAMES[:4])}...); "
        f"name them in watch.attention.projections"
    )


def _separate(q: nn.Module, k: nn.Module, q_name: str, k_name: str, heads: int | None, kv_heads: int | None) -> QKSpec:
    (q_out, transposed), (k_out, _) = _out_features(q), _out_features(k)  # type: ignore[misc]
    if heads and not kv_heads and q_out % heads == 0:
        kv_heads = max(1, k_out // (q_out // heads))
    return QKSpec(
        q_weight=q_name + ".weight",
        k_weight=k_name + ".weight",
        q_rows=(0, q_out),
        k_rows=(0, k_out),
        q_bias=q_name + ".bias" if getattr(q, "bias", None) is not None else None,
        k_bias=k_name + ".bias" if getattr(k, "bias", None) is not None else None,
        heads=heads,
        kv_heads=kv_heads or heads,
        transposed=transposed,
    )


def _fused(lin: nn.Module, name: str, heads: int | None, kv_heads: int | None) -> QKSpec | None:
    """q|k|v blocks of rows; with GQA (kv_heads < heads) the k and v blocks are smaller."""
    shape = _out_features(lin)
    if shape is None:
        return None
    out, transposed = shape
    if heads and kv_heads and kv_heads != heads:
        unit = out // (heads + 2 * kv_heads)  # rows per head
        if unit * (heads + 2 * kv_heads) != out:
            return None
        qn, kn = heads * unit, kv_heads * unit
    else:
        if out % 3:
            return None
        qn = kn = out // 3
    return QKSpec(
        q_weight=name + ".weight",
        k_weight=name + ".weight",
        q_rows=(0, qn),
        k_rows=(qn, qn + kn),
        q_bias=name + ".bias" if getattr(lin, "bias", None) is not None else None,
        k_bias=name + ".bias" if getattr(lin, "bias", None) is not None else None,
        heads=heads,
        kv_heads=kv_heads or heads,
        layout="fused",
        transposed=transposed,
    )


# --------------------------------------------------------------------------------------------
# QK-Clip
# --------------------------------------------------------------------------------------------


def qk_clip_factors(
    head_max: list[float], tau: float, kv_heads: int | None = None
) -> tuple[list[float], list[float], list[float]]:
    """(gamma per head, q scale per head, k scale per kv head) so that head h's logits are
    multiplied by gamma_h = min(1, tau / max_h): Kimi K2 scales W_q and W_k by sqrt(gamma) each.
    With grouped keys (kv_heads < heads) a key head shared by a group is scaled by sqrt of the
    group's smallest gamma and each query head makes up the rest, so every head still gets
    exactly its gamma. A non-finite max cannot size a clip: that head keeps gamma 1."""
    gammas = [tau / m if (math.isfinite(m) and m > tau) else 1.0 for m in head_max]
    H = len(gammas)
    G = kv_heads if kv_heads and H % kv_heads == 0 else H
    per = H // G
    k_scale = [math.sqrt(min(gammas[g * per : (g + 1) * per])) for g in range(G)]
    q_scale = [gammas[h] / k_scale[h // per] for h in range(H)]
    return gammas, q_scale, k_scale


def _rows_scale(t: torch.Tensor, start: int, stop: int, scales: list[float], dim: int = 0) -> None:
    """Multiply rows [start, stop) of ``t`` along ``dim``, split into len(scales) equal blocks."""
    n = len(scales)
    size = (stop - start) // n
    for i, s in enumerate(scales):
        if s != 1.0:  # FSDP2: each rank scales the part of the rows its shard holds
            scale_slice_(t, dim, start + i * size, size, s)


def apply_qk_clip(model: nn.Module, spec: QKSpec, q_scale: list[float], k_scale: list[float]) -> None:
    """Rescale the query rows (per head) and key rows (per key head) of ``spec`` in place."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for w, b, rows, scales in (
            (spec.q_weight, spec.q_bias, spec.q_rows, q_scale),
            (spec.k_weight, spec.k_bias, spec.k_rows, k_scale),
        ):
            _rows_scale(params[w], rows[0], rows[1], scales, dim=1 if spec.transposed else 0)
            if b is not None:
                _rows_scale(params[b], rows[0], rows[1], scales)
        for name in spec.k_extra:
            p = params[name]
            _rows_scale(p, 0, p.shape[-1], k_scale, dim=p.ndim - 1)
    own_write([params[n] for n in _qk_names(spec)])  # (not the loop's change of the weights)


def _update_will_be_skipped(ctx: Any) -> bool:
    """True when this step's update will not land: a skip or rollback decided this step, or the
    GradScaler found inf/NaN and will not call optimizer.step (the monitor read that in the step's
    one host read: ``ctx.scaler_skips``)."""
    return bool(getattr(ctx, "skip", False) or getattr(ctx, "scaler_skips", False))


@register_action(QK_CLIP, order=45, per_finding=True)
def qk_clip(ctx: Any, decision: Decision) -> dict[str, Any]:
    """QK-Clip (Kimi K2): after this step's update, every head of the finding's module whose max
    logit passes the cap gets its W_q rows and W_k rows rescaled so that its logits shrink by
    gamma = cap / max (sqrt(gamma) each); other heads and the rest of the model are untouched.

    The max is the one the *updated* weights give: the activation watch re-runs the module on the
    sampled step's own input after the update (exact for that batch); the logits of the forward
    that ran before the update are only a fallback (no watch, a sharded FSDP2 module). One AdamW
    step at a high LR can multiply the logits several-fold: a clip sized from the old logits
    leaves the next forward far over tau (docs/benchmarks.md, LR sweep). The cap is tau less the
    headroom the watch has seen the next batch need (``ActivationWatch.clip_target``)."""
    data = decision.cause.data
    att = data.get("attention", data)  # an activation_overflow finding carries its module's logits
    module = att.get("module") or decision.cause.where
    spec_d, head_max, tau = att.get("projection"), att.get("head_max"), att.get("tau")
    if not spec_d:
        reason = att.get("projection_reason") or f"module {module!r} has no measured attention logits"
        return {"applied": False, "module": module, "reason": reason}
    if not head_max or tau is None:
        return {"applied": False, "module": module, "reason": "the finding carries no per-head max logits"}
    spec = QKSpec.from_dict(spec_d)
    head_max = [float(m) for m in head_max]
    held = bool(att.get("held"))
    cap = float(att.get("clip_target", tau))
    facts = _clip_facts(spec, module, head_max, float(tau), cap)
    factors = facts.pop("_factors", None)
    if att.get("clipped_before_forward"):
        # The watch's check of this held module clipped it before this step's forward.
        facts["clipped_before_forward"] = att["clipped_before_forward"]
    if _update_will_be_skipped(ctx):
        # The weights stay as they are: the logits just measured are the ones to clip.
        if factors is not None:
            apply_qk_clip(ctx.model, spec, *factors)
            facts.update(applied=True, when="now: this step's update does not land")
            watch = WATCHES.get(ctx.model)
            if watch is not None:
                watch.clipped(module, min(max(head_max), cap), True, now=True)
        return facts
    if factors is None and not held:
        return facts  # nothing over the cap (applied False, with the reason)
    watch = WATCHES.get(ctx.model)
    sharded = any(is_sharded(p) for n, p in ctx.model.named_parameters() if n in (spec.q_weight, spec.k_weight))
    facts.pop("reason", None)
    facts.update(applied=True, when="after this step's update", measured="pending")
    _after_update(
        ctx, lambda: _clip_after_update(ctx.model, spec, module, head_max, float(tau), cap, facts, watch, sharded)
    )
    return facts


def _clip_facts(spec: QKSpec, module: str, head_max: list[float], tau: float, cap: float) -> dict[str, Any]:
    """What a clip of ``head_max`` down to ``cap`` does to ``spec``'s heads (the scales under the
    private key ``_factors``, absent when no head is clipped)."""
    H = len(head_max)
    q_rows = spec.q_rows[1] - spec.q_rows[0]
    if H > 1 and (q_rows % H or (spec.heads is not None and spec.heads != H)):
        # The logits' heads and the projection's do not line up: clip the module as one head.
        head_max, H = [max(head_max)], 1
    kv = spec.kv_heads if H > 1 else 1
    k_rows = spec.k_rows[1] - spec.k_rows[0]
    if H > 1 and (not kv or k_rows % kv):
        # Key heads the module does not declare: as many as the key rows hold heads of the query
        # heads' width (grouped keys: fewer), else the module is clipped as one head.
        d_head = q_rows // H
        kv = k_rows // d_head if k_rows % d_head == 0 and H % (k_rows // d_head) == 0 else 1
        if kv == 1 and H > 1:
            head_max, H = [max(head_max)], 1
    gammas, q_scale, k_scale = qk_clip_factors(head_max, cap, kv)
    clipped = [h for h, g in enumerate(gammas) if g < 1.0]
    unsized = [h for h, m in enumerate(head_max) if not math.isfinite(m)]
    facts: dict[str, Any] = {
        "module": module,
        "tau": tau,
        "max_logit": max(head_max),
        "heads_clipped": clipped,
        "gamma": [round(g, 6) for g in gammas],
        "q_scale": [round(s, 6) for s in q_scale],
        "k_scale": [round(s, 6) for s in k_scale],
        "q_weight": spec.q_weight,
        "k_weight": spec.k_weight,
    }
    if cap != tau:
        facts["clip_target"] = cap
    if unsized:
        facts["unsized_heads"] = unsized  # non-finite max: no exact value to size a clip from
    if clipped:
        facts["_factors"] = (q_scale, k_scale)
    else:
        facts.update(applied=False, reason=f"no head's finite max logit is above {cap:g}")
    return facts


def clip_now(
    model: nn.Module, spec: QKSpec, module: str, head_max: list[float], tau: float, cap: float
) -> dict[str, Any] | None:
    """Clip ``spec``'s heads whose max logit (``head_max``, exact, measured on the weights as they
    are) passes ``cap``, now; what was done, or None when no head was over. The activation watch's
    check of a held module before its forward (``ActivationWatch``)."""
    facts = _clip_facts(spec, module, head_max, tau, cap)
    factors = facts.pop("_factors", None)
    if factors is None:
        return None
    apply_qk_clip(model, spec, *factors)
    facts.update(applied=True, when="before this step's forward", measured="on this forward's input")
    return facts


def _clip_after_update(
    model: nn.Module,
    spec: QKSpec,
    module: str,
    head_max: list[float],
    tau: float,
    cap: float,
    facts: dict[str, Any],
    watch: Any,
    sharded: bool,
) -> None:
    """Run right after the update: size the clip from the logits the updated weights give on the
    sampled step's input (one host read, on steps with a clip only), or from the logits measured
    before the update when they cannot be recomputed; tell the watch what is left."""
    after, remeasured = None, False
    # Re-measured on this process's own input only: with several processes (DDP: a full copy of
    # the weights each, a different batch each) every rank would size its own clip and the copies
    # would part for good. There the logits read before the update, reduced across ranks, decide.
    alone = world_size() == 1
    if watch is not None and not sharded and alone:
        after = watch.remeasure(module, keep=True)  # kept: the clip is checked on the same input
    if after is not None and len(after) == len(head_max):
        remeasured = True
        new = _clip_facts(spec, module, after, tau, cap)
        facts.update(new, measured="after the update, on this step's input", max_logit_before_update=max(head_max))
        for key in ("applied", "reason"):
            if key not in new:
                facts.pop(key, None)
        facts.setdefault("applied", True)
    else:
        new = _clip_facts(spec, module, head_max, tau, cap)
        facts.update(new, measured="before the update (not recomputable after it)")
        if "_factors" in new:
            facts["applied"] = True
            facts.pop("reason", None)
        after = head_max
    factors = facts.pop("_factors", None)
    gammas = facts["gamma"]
    left = [m * g for m, g in zip(after, gammas)] if len(gammas) == len(after) else [min(max(after), cap)]
    if factors is not None:
        saved = _qk_tensors(model, spec) if remeasured else None
        apply_qk_clip(model, spec, *factors)
        check = watch.remeasure(module) if saved is not None else None
        if saved is not None and check is not None and max(check) > max(after) - 0.5 * (max(after) - max(left)):
            # Less than half the reduction it was sized for: the logits do not scale with these
            # rows (queries and keys normalised after the projections: qk-layernorm; or a layout
            # the spec misreads). Clipping again and again would only shrink the weights under the
            # norm. Put them back exactly and stop clipping this module.
            with torch.no_grad():
                for t, copy_ in saved:
                    t.copy_(copy_)
            own_write([t for t, _ in saved])
            reason = (
                f"QK-Clip did not lower {module!r}'s logits (max {max(after):.4g}, {max(check):.4g} after a clip "
                f"sized for {max(left):.4g}): its queries and keys do not scale with {spec.q_weight} and "
                f"{spec.k_weight} (normalised after the projections?); put back, not tried again"
            )
            facts.update(applied=False, reason=reason, max_logit_after_clip=max(check))
            watch.unclippable(module, reason)
            return
    if watch is not None:
        watch.clipped(module, max(left), max(after) > cap)


def _qk_names(spec: QKSpec) -> list[str]:
    """The names of the parameters a clip of ``spec`` scales, each once."""
    names = [spec.q_weight, spec.k_weight, spec.q_bias, spec.k_bias, *spec.k_extra]
    return [n for n in dict.fromkeys(names) if n is not None]


def _qk_tensors(model: nn.Module, spec: QKSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, copy) of every tensor a clip of ``spec`` scales, to put them back exactly."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        return [(params[n], params[n].detach().clone()) for n in _qk_names(spec)]


# Clips waiting for their optimizer's step to land, and the one post-hook per optimizer that
# applies them (a hook cannot remove itself while the optimizer iterates over its hooks).
_PENDING: weakref.WeakKeyDictionary[Any, list[Callable[[], None]]] = weakref.WeakKeyDictionary()
_HOOKS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _after_update(ctx: Any, fn: Callable[[], None]) -> None:
    """Run ``fn`` right after ``ctx.optimizer``'s next step (after the monitor's own post-hook).
    The hook is removed with the monitor's other hooks on detach (``ctx.hooks``)."""
    opt = ctx.optimizer
    _PENDING.setdefault(opt, []).append(fn)
    handle = _HOOKS.get(opt)
    if handle is None or handle.id not in opt._optimizer_step_post_hooks:

        def run_pending(optimizer: Any, args: Any, kwargs: Any) -> None:
            todo = _PENDING.pop(optimizer, [])
            for f in todo:
                f()

        handle = _HOOKS[opt] = opt.register_step_post_hook(run_pending)
        hooks = getattr(ctx, "hooks", None)
        if isinstance(hooks, list):
            hooks.append(handle)


# Its own kind (not activation_overflow, whose limit is the dtype's max): every sampled step on
# which a module's max logit is above tau clips that module (Kimi K2 checks every step).
register_kind(
    ATTENTION_LOGIT_GROWTH,
    [(1, [QK_CLIP])],
    window=0,
    doc="an attention module's max logit passed the cap watch.attention.tau",
)


# Told, no action: attention that turned one-hot under the cap tau is a warning (Zhai et al. 2023:
# entropy collapse comes with unstable training), and legitimately sharp heads exist; QK-Clip
# answers the logits once they pass tau.
register_kind(
    ATTENTION_ENTROPY_COLLAPSE,
    [(1, [])],
    window=0,
    doc="an attention module's mean softmax entropy fell under a small fraction of its start",
)


def routine_check(event: Event) -> bool:
    """An ``attention_logit_growth`` event of a held module's check (``held``; nothing over tau in
    ``heads_over``: a module held after a clip is checked after every update) whose QK-Clip
    clipped nothing, before the forward or after the update: routine, not an event (the monitor
    leaves it out of its events and its files). A probe's post-LN runs had 445-655 such events
    each, one per held module and step, beside a few clips."""
    data = event.data or {}
    return (
        event.kind == ATTENTION_LOGIT_GROWTH
        and bool(data.get("held"))
        and not data.get("heads_over")
        and not data.get("clipped_before_forward")
        and not event.changed()
    )


def finding(
    step: int,
    module: str,
    head_max: list[float],
    tau: float,
    spec: QKSpec | None,
    spec_reason: str,
    forecast: Mapping[str, Any],
) -> Finding:
    """The attention_logit_growth finding of one module whose max logit passed tau."""
    top = max(head_max)
    over = [h for h, m in enumerate(head_max) if not (m <= tau)]
    heads = f"head{'s' if len(over) > 1 else ''} {', '.join(map(str, over))}" if len(head_max) > 1 else "its logits"
    what = f"max logit {top:.4g} passed tau={tau:g} ({heads})"
    if not over:  # a held module (a clip was needed lately): its logits are checked after the update
        what = f"max logit {top:.4g} (tau={tau:g}), held after a clip: checked again after the update"
        pre = forecast.get("clipped_before_forward")
        if pre:
            what += f" (clipped from {pre['max_logit']:.4g} before this step's forward)"
    data: dict[str, Any] = {
        "module": module,
        "max_logit": top,
        "tau": tau,
        "head_max": head_max,
        "heads_over": over,
        "projection": spec.to_dict() if spec is not None else None,
        **dict(forecast),
    }
    if spec is None:
        data["projection_reason"] = spec_reason
    return Finding(
        ATTENTION_LOGIT_GROWTH,
        f"step {step}: attention module {module!r}: {what}",
        data,
        where=module,
    )
