"""Superfusion: a small late-fusion image+text model that fails the way the field report says.

Read top to bottom:
  Vision   patch CNN over 3x32x32 images -> 16 image tokens (B, 16, d) + shape head  -> L_v
  Text     token embedding + positions + TransformerEncoder -> token features (B, T, d) + head -> L_t
  Fusion   one query per caption from the pooled text, keys/values from the image tokens,
           a hand-written cross-attention (q @ k^T inline, softmax, values), cosine score against
           the caption, divided by a learnable temperature tau -> cross-entropy over K candidate
           captions (1 true + K-1 hard negatives)                                            -> L_f

The trap (configs/trap.yaml) is the report's setting: text features are *summed* over tokens (no
length normalisation) and the query-key product is unscaled and computed in fp16 under autocast.
The image-token norms grow as the vision branch learns, the scores grow with caption length times
key norm, and the longest captions eventually push a score past float16's 65504: +inf -> NaN in
the softmax -> NaN loss. Nothing is injected: switch ``length_norm``, ``scaled_attention`` or
``fp32_attention`` on and it does not happen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._schema import Config, ConfigError, option

# Loss-component names: the keys of forward()'s dict and of monitor.combine()'s weights.
VISION = "vision"
TEXT = "text"
FUSION = "fusion"
LOSS_NAMES = (VISION, TEXT, FUSION)
PAD = 0  # padding token id; every tokenizer in data.py reserves it


@dataclass
class ModelConfig(Config):
    """Superfusion's shape and its stability switches."""

    vocab_size: int = option(400, "text vocabulary size (data.py sets it from the tokenizer)", lo=2)
    max_len: int = option(600, "longest caption in tokens (learned positions)", lo=1)
    d_model: int = option(64, "feature width of every branch (proving ground: 64)", lo=8)
    text_layers: int = option(1, "TransformerEncoder layers of the text branch", lo=1, hi=12)
    text_heads: int = option(2, "attention heads of the text encoder", lo=1)
    text_ff: int = option(128, "feed-forward width of the text encoder", lo=8)
    fusion_heads: int = option(2, "heads of the fusion cross-attention (2 x 32 at d=64)", lo=1)
    num_classes: int = option(8, "classes of the vision and text heads (product category)", lo=2)
    length_norm: bool = option(
        False,
        "mean-pool the text tokens for the fusion query; off (sum "
        "pooling, the report's 'not length-normalised') in the trap",
    )
    scaled_attention: bool = option(False, "divide the fusion's q k^T by sqrt(d_head); off in the trap")
    fp32_attention: bool = option(
        False,
        "compute the fusion logits and softmax in fp32 under "
        "autocast; off in the trap (the monitor's precision fallback "
        "turns it on at run time via model.fusion.fp32_attention)",
    )
    qk_init_gain: float = option(
        1.0,
        "multiplier on the default init of the fusion's Wq and Wk; the calibration knob of the trap",
        lo=0.0,
        lo_open=True,
    )
    temperature_init: float = option(
        0.07, "initial softmax temperature tau of the matching cross-entropy (report: 0.07)", lo=0.0, lo_open=True
    )
    learn_temperature: bool = option(True, "tau is a learned parameter (else fixed)")
    mask_ratio: float = option(
        0.0,
        "modality masking: share of image patches and text tokens dropped at random in training (report: 0.15)",
        lo=0.0,
        hi=0.9,
    )
    dropout: float = option(0.0, "dropout in the text encoder and the fusion output", lo=0.0, hi=0.9)
    text_fp32: bool = option(
        True, "run the text encoder with autocast off (fp16 matmuls are ~10x slower than fp32 on CPU)"
    )

    def validate(self) -> None:
        for name in ("text_heads", "fusion_heads"):
            if self.d_model % getattr(self, name):
                raise ConfigError(
                    f"{self._prefix}{name}: {getattr(self, name)} does not divide {self._prefix}d_model={self.d_model}"
                )


class VisionBranch(nn.Module):
    """Patch CNN: (B, 3, 32, 32) -> 16 tokens (B, 16, d); head: mean token -> class logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.patch = nn.Conv2d(3, d // 2, kernel_size=4, stride=4)  # 32x32 -> 8x8
        self.merge = nn.Conv2d(d // 2, d, kernel_size=2, stride=2)  # 8x8 -> 4x4
        self.pos = nn.Parameter(torch.zeros(1, 16, d))
        self.head = nn.Linear(d, cfg.num_classes)
        self.mask_ratio = cfg.mask_ratio

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.gelu(self.patch(images))  # (B, d/2, 8, 8)
        x = self.merge(x)  # (B, d, 4, 4)
        tokens = x.flatten(2).transpose(1, 2) + self.pos  # (B, 16, d)
        if self.training and self.mask_ratio > 0:  # modality masking: drop patches
            keep = torch.rand(tokens.shape[:2], device=tokens.device) >= self.mask_ratio
            tokens = tokens * keep.unsqueeze(-1).to(tokens.dtype)
        logits = self.head(tokens.mean(1))  # (B, classes)
        return tokens, logits


class TextBranch(nn.Module):
    """Embedding + learned positions + TransformerEncoder: (N, T) ids -> (N, T, d) features."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, d, padding_idx=PAD)
        self.pos = nn.Embedding(cfg.max_len, d)
        layer = nn.TransformerEncoderLayer(d, cfg.text_heads, cfg.text_ff, dropout=cfg.dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.text_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, cfg.num_classes)
        self.mask_ratio = cfg.mask_ratio
        self.fp32 = cfg.text_fp32
        self.max_len = cfg.max_len

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ids.shape[1] > self.max_len:
            raise ValueError(f"caption of {ids.shape[1]} tokens exceeds model.max_len={self.max_len}")
        pad = ids == PAD  # (N, T)
        if self.training and self.mask_ratio > 0:  # modality masking: drop tokens
            drop = torch.rand(ids.shape, device=ids.device) < self.mask_ratio
            drop &= ~pad
            drop[:, 0] = False  # keep at least one token
            pad = pad | drop
        with torch.autocast(ids.device.type, enabled=not self.fp32 and torch.is_autocast_enabled(ids.device.type)):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.embed(ids) + self.pos(pos)  # (N, T, d)
            x = self.encoder(x, src_key_padding_mask=pad)  # (N, T, d)
            x = x.masked_fill(pad.unsqueeze(-1), 0.0)
        return x, pad


class Fusion(nn.Module):
    """Cross-attention from a pooled caption query to the image tokens, then a matching score.

    The attention logits are computed inline (``q @ k.transpose(-1, -2)``) so an activation watch
    on this module sees them. Switches: length_norm, scaled_attention, fp32_attention.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.fusion_heads
        self.heads, self.d_head = h, d // h
        self.wq = nn.Linear(d, d)
        self.wk = nn.Linear(d, d)
        self.wv = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.text_proj = nn.Linear(d, d)
        self.drop = nn.Dropout(cfg.dropout)
        with torch.no_grad():  # the calibration knob
            self.wq.weight.mul_(cfg.qk_init_gain)
            self.wk.weight.mul_(cfg.qk_init_gain)
        log_tau = torch.tensor(math.log(cfg.temperature_init))
        if cfg.learn_temperature:
            self.log_tau = nn.Parameter(log_tau)
        else:
            self.register_buffer("log_tau", log_tau)
        self.length_norm = cfg.length_norm
        self.scaled_attention = cfg.scaled_attention
        self.fp32_attention = cfg.fp32_attention
        self.last_max_logit = torch.zeros(())  # largest |q k^T| of the last forward (diagnostics)

    def pool(self, text: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """(N, T, d) -> (N, d): sum over tokens, or mean with length_norm."""
        pooled = text.sum(1)  # padded positions are zero
        if self.length_norm:
            pooled = pooled / (~pad).sum(1, keepdim=True).clamp(min=1)
        return pooled

    def forward(self, image_tokens: torch.Tensor, text: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """image_tokens (B, P, d), text (B, K, T, d), pad (B, K, T) -> match logits (B, K)."""
        B, K, T, d = text.shape
        P = image_tokens.shape[1]
        pooled = self.pool(text.reshape(B * K, T, d), pad.reshape(B * K, T)).reshape(B, K, d)
        with torch.autocast(image_tokens.device.type, enabled=False) if self.fp32_attention else _null():
            if self.fp32_attention:
                pooled, image_tokens = pooled.float(), image_tokens.float()
            q = self.wq(pooled).reshape(B, K, self.heads, self.d_head).transpose(1, 2)  # (B, H, K, dh)
            k = self.wk(image_tokens).reshape(B, P, self.heads, self.d_head).transpose(1, 2)  # (B, H, P, dh)
            v = self.wv(image_tokens).reshape(B, P, self.heads, self.d_head).transpose(1, 2)  # (B, H, P, dh)
            if self.fp32_attention:
                q, k, v = q.float(), k.float(), v.float()
            scores = q @ k.transpose(-1, -2)  # (B, H, K, P)  <- overflows in fp16
            if self.scaled_attention:
                scores = scores / math.sqrt(self.d_head)
            attn = scores.softmax(dim=-1)  # (B, H, K, P)
            ctx = attn @ v  # (B, H, K, dh)
        self.last_max_logit = scores.detach().abs().amax()  # 0-d tensor, no host read
        ctx = ctx.transpose(1, 2).reshape(B, K, d)  # (B, K, d)
        fused = self.drop(self.out(ctx))  # (B, K, d)
        cap = self.text_proj(pooled)  # (B, K, d)
        cos = F.cosine_similarity(fused.float(), cap.float(), dim=-1)  # (B, K)
        return cos / self.log_tau.exp()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class Superfusion(nn.Module):
    """Top-level children: ``vision``, ``text``, ``fusion`` (the monitor's default groups)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.vision = VisionBranch(cfg)
        self.text = TextBranch(cfg)
        self.fusion = Fusion(cfg)

    def scores_and_losses(
        self, images: torch.Tensor, captions: torch.Tensor, target: torch.Tensor, category: torch.Tensor, **_: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """images (B, 3, 32, 32), captions (B, K, T) ids, target (B,) index of the true caption,
        category (B,) class -> (match logits (B, K), {"vision", "text", "fusion"} scalar losses)."""
        B, K, T = captions.shape
        image_tokens, v_logits = self.vision(images)  # (B, 16, d), (B, C)
        text, pad = self.text(captions.reshape(B * K, T))  # (B*K, T, d), (B*K, T)
        text, pad = text.reshape(B, K, T, -1), pad.reshape(B, K, T)
        true_text = text[torch.arange(B), target]  # (B, T, d)
        true_pad = pad[torch.arange(B), target]  # (B, T)
        n_tok = (~true_pad).sum(1, keepdim=True).clamp(min=1)
        t_logits = self.text.head((true_text.sum(1) / n_tok).to(true_text.dtype))  # (B, C)
        scores = self.fusion(image_tokens, text, pad)  # (B, K)
        losses = {
            VISION: F.cross_entropy(v_logits.float(), category),
            TEXT: F.cross_entropy(t_logits.float(), category),
            FUSION: F.cross_entropy(scores.float(), target),
        }
        return scores, losses

    def forward(self, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """model(**batch) -> {"vision": L_v, "text": L_t, "fusion": L_f} (scalar tensors)."""
        return self.scores_and_losses(**batch)[1]

    @torch.no_grad()
    def score(self, **batch: torch.Tensor) -> torch.Tensor:
        """Retrieval scores (B, K): rank the K candidate captions of each image."""
        return self.scores_and_losses(**batch)[0]


def build_model(cfg: ModelConfig | dict | None = None) -> Superfusion:
    """Build Superfusion from a ModelConfig or a dict of its keys (unknown keys raise ConfigError)."""
    if cfg is None:
        cfg = ModelConfig()
    elif isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg, prefix="model.")
    elif not isinstance(cfg, ModelConfig):
        raise TypeError(f"build_model expects a ModelConfig or a dict, got {type(cfg).__name__}")
    return Superfusion(cfg)
