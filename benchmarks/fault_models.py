"""The small third-party-style models of benchmarks/faults.py, each with its data and its faults.

Every task builds its model and optimizer from the global seed (``torch.manual_seed`` first),
generates its batches deterministically from a seed (the same batches, in the same order, for
every arm of a comparison) and knows how to spoil one batch:

* ``poison``: a NaN in the batch. Where the model takes a float input (the CNN's images) it is one
  NaN pixel, an input the monitor can see; the token models take integer ids, so there it is the
  batch's float loss weight (a data-mixture weight, 1.0 on every healthy batch) that is NaN;
* ``garbage``: a batch of noise with random labels (a corrupt shard);
* ``scramble``: the right inputs with random labels (a stretch of corrupted labels).

Nothing is downloaded: the GPT and the BERT read the Python standard library's own sources (as
benchmarks/lr_sweep.py does), the CNN sees synthetic images. Not part of the test suite (a smoke
run is: tests/test_benchmark_faults.py).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lr_sweep import encode, stdlib_text

Batch = dict[str, torch.Tensor]


@dataclass
class Task:
    """A model recipe. Subclasses fill in the model, the data and the faults."""

    name: str = ""
    lr: float = 1e-3
    clip: float = 0.0  # clip_grad_norm_ before optimizer.step (0: off)
    batch: int = 16
    eval_n: int = 8  # held-out batches
    about: str = ""  # one line for the docs
    extra: dict[str, Any] = field(default_factory=dict)

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def train_batches(self, n: int, seed: int) -> list[Batch]:
        raise NotImplementedError

    def eval_batches(self) -> list[Batch]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def poison(self, batch: Batch) -> Batch:
        out = dict(batch)
        out["weight"] = torch.tensor(float("nan"))
        return out

    def garbage(self, batch: Batch, g: torch.Generator) -> Batch:
        raise NotImplementedError

    def rescale(self, batch: Batch) -> Batch:
        """The batch's inputs at 1e3x their scale (images whose normalisation was skipped)."""
        raise NotImplementedError

    def scramble(self, batch: Batch, g: torch.Generator) -> Batch:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# Text: the standard library's sources, as characters
# --------------------------------------------------------------------------------------------

_TEXT: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}


def text_ids(chars: int = 300_000) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train ids, held-out ids, vocabulary): 90/10 split of the first ``chars`` characters."""
    if chars not in _TEXT:
        ids, vocab = encode(stdlib_text(chars))
        split = int(0.9 * len(ids))
        _TEXT[chars] = (ids[:split], ids[split:], vocab)
    return _TEXT[chars]


def windows(ids: torch.Tensor, n: int, batch: int, length: int, g: torch.Generator) -> list[torch.Tensor]:
    """``n`` batches of ``batch`` random windows of ``length`` ids."""
    out = []
    for _ in range(n):
        start = torch.randint(0, len(ids) - length, (batch,), generator=g)
        out.append(torch.stack([ids[s : s + length] for s in start.tolist()]))
    return out


# --------------------------------------------------------------------------------------------
# GPT: nanoGPT-style, one parameter group, AdamW, clip before optimizer.step
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = self.ln_1(x)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in self.c_attn(h).split(D, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's shape: token + position embeddings, pre-LN blocks, tied LM head, GPT-2 init."""

    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4, context: int = 32):
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, d),
                "wpe": nn.Embedding(context, d),
                "h": nn.ModuleList(Block(d, heads) for _ in range(layers)),
                "ln_f": nn.LayerNorm(d),
            }
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight  # weight tying, as nanoGPT
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t["wte"](idx) + t["wpe"](torch.arange(idx.shape[1], device=idx.device))
        for block in t["h"]:
            x = block(x)
        return self.lm_head(t["ln_f"](x))


@dataclass
class GPTTask(Task):
    name: str = "gpt"
    lr: float = 1e-3  # nanoGPT's shakespeare_char: 1e-3, betas (0.9, 0.99), weight decay 0.1, clip 1.0
    clip: float = 1.0
    batch: int = 16
    context: int = 32
    d: int = 64
    layers: int = 2
    about: str = (
        "char-level GPT (nanoGPT-style: 2 pre-LN blocks, d=64, 4 heads, context 32, tied head), "
        "AdamW 1e-3 betas (0.9, 0.99) wd 0.1, one parameter group, clip_grad_norm_ 1.0 before "
        "optimizer.step, no warm-up; Python standard library text"
    )

    def build(self):
        model = GPT(text_ids()[2], d=self.d, layers=self.layers, context=self.context)
        opt = torch.optim.AdamW(model.parameters(), lr=self.lr, betas=(0.9, 0.99), weight_decay=0.1)
        return model, opt

    def _batches(self, ids, n, g):
        return [
            {"x": w[:, :-1], "y": w[:, 1:], "weight": torch.tensor(1.0)}
            for w in windows(ids, n, self.batch, self.context + 1, g)
        ]

    def train_batches(self, n, seed):
        return self._batches(text_ids()[0], n, torch.Generator().manual_seed(seed))

    def eval_batches(self):
        return self._batches(text_ids()[1], self.eval_n, torch.Generator().manual_seed(10_000))

    def loss(self, model, batch):
        logits = model(batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten()) * batch["weight"]

    def garbage(self, batch, g):
        vocab = text_ids()[2]
        return {**batch, "x": torch.randint(0, vocab, batch["x"].shape, generator=g), "y": _rand_like(batch["y"], g)}

    def scramble(self, batch, g):
        return {**batch, "y": _rand_like(batch["y"], g)}


def _rand_like(ids: torch.Tensor, g: torch.Generator, vocab: int | None = None) -> torch.Tensor:
    return torch.randint(0, vocab or text_ids()[2], ids.shape, generator=g)


# --------------------------------------------------------------------------------------------
# BERT: transformers' BertForMaskedLM from a tiny BertConfig (no download)
# --------------------------------------------------------------------------------------------


@dataclass
class BertTask(Task):
    name: str = "bert"
    lr: float = 1e-3
    clip: float = 0.0
    batch: int = 16
    length: int = 32
    about: str = (
        "transformers BertForMaskedLM(BertConfig(hidden 64, 2 layers, 2 heads, intermediate 128)), "
        "dropout 0.1 (the config's default), masked-LM on characters (15%: 80/10/10), AdamW 1e-3, no clipping"
    )

    @property
    def mask_id(self) -> int:
        return text_ids()[2]  # one past the characters

    def config(self):
        from transformers import BertConfig

        return BertConfig(
            vocab_size=self.mask_id + 1,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=64,
        )

    def build(self):
        from transformers import BertForMaskedLM

        model = BertForMaskedLM(self.config())
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr)

    def _batches(self, ids, n, g):
        out = []
        for w in windows(ids, n, self.batch, self.length, g):
            labels = torch.full_like(w, -100)
            pick = torch.rand(w.shape, generator=g) < 0.15
            labels[pick] = w[pick]
            inp = w.clone()
            r = torch.rand(w.shape, generator=g)
            inp[pick & (r < 0.8)] = self.mask_id
            rand = pick & (r >= 0.8) & (r < 0.9)
            inp[rand] = torch.randint(0, self.mask_id, (int(rand.sum()),), generator=g)
            out.append(
                {
                    "input_ids": inp,
                    "attention_mask": torch.ones_like(w),
                    "labels": labels,
                    "weight": torch.tensor(1.0),
                }
            )
        return out

    def train_batches(self, n, seed):
        return self._batches(text_ids()[0], n, torch.Generator().manual_seed(seed))

    def eval_batches(self):
        return self._batches(text_ids()[1], self.eval_n, torch.Generator().manual_seed(10_000))

    def loss(self, model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        return out.loss * batch["weight"]

    def garbage(self, batch, g):
        ids = torch.randint(0, self.mask_id, batch["input_ids"].shape, generator=g)
        labels = torch.where(batch["labels"] >= 0, _rand_like(batch["labels"], g, self.mask_id), batch["labels"])
        return {**batch, "input_ids": ids, "labels": labels}

    def scramble(self, batch, g):
        labels = torch.where(batch["labels"] >= 0, _rand_like(batch["labels"], g, self.mask_id), batch["labels"])
        return {**batch, "labels": labels}


# --------------------------------------------------------------------------------------------
# CNN: conv + BatchNorm on synthetic images, SGD with momentum
# --------------------------------------------------------------------------------------------


class CNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@dataclass
class CNNTask(Task):
    name: str = "cnn"
    lr: float = 0.02
    clip: float = 0.0
    batch: int = 32
    classes: int = 10
    about: str = (
        "2 conv + BatchNorm layers and an MLP head on synthetic 3x16x16 images (10 classes: a fixed "
        "template per class, shifted, plus noise), SGD 0.02 momentum 0.9 wd 5e-4, no clipping"
    )

    def build(self):
        model = CNN(self.classes)
        return model, torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)

    def _templates(self) -> torch.Tensor:
        return torch.randn(self.classes, 3, 16, 16, generator=torch.Generator().manual_seed(1234))

    def _batches(self, n, g):
        t = self._templates()
        out = []
        for _ in range(n):
            y = torch.randint(0, self.classes, (self.batch,), generator=g)
            shift = torch.randint(-2, 3, (2,), generator=g).tolist()
            x = torch.roll(t[y], shifts=shift, dims=(2, 3)) + 1.5 * torch.randn(self.batch, 3, 16, 16, generator=g)
            out.append({"x": x, "y": y})
        return out

    def train_batches(self, n, seed):
        return self._batches(n, torch.Generator().manual_seed(seed))

    def eval_batches(self):
        return self._batches(self.eval_n, torch.Generator().manual_seed(10_000))

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    def poison(self, batch):
        x = batch["x"].clone()
        x[0, 0, 0, 0] = float("nan")
        return {**batch, "x": x}

    def garbage(self, batch, g):
        x = 3.0 * torch.randn(batch["x"].shape, generator=g)
        return {"x": x, "y": torch.randint(0, self.classes, batch["y"].shape, generator=g)}

    def scramble(self, batch, g):
        return {**batch, "y": torch.randint(0, self.classes, batch["y"].shape, generator=g)}

    def rescale(self, batch):
        return {**batch, "x": 1e3 * batch["x"]}


TASKS: dict[str, type[Task]] = {"gpt": GPTTask, "bert": BertTask, "cnn": CNNTask}
