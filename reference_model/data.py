"""Product image-text pairs: a deterministic synthetic e-commerce set and a real-data folder loader.

Synthetic set (``make_synthetic``): each product has a category (shape), a colour and a pattern,
rendered as a noisy 3x32x32 image. Its caption is a long product description of filler words with
the three attribute words at random places; lengths are lognormal (median 50, sigma 1.0) clipped to
10..600, so a few captions are 10-50x longer than others (the report's "10 vs 500+ tokens").
Every image comes with K candidate captions: the true one and K-1 hard negatives (the same
description and category with other colour/pattern words), so the negative share is (K-1)/K
(default 0.9, the report's 90% negatives).

Folder set (``load_folder``): ``captions.jsonl`` rows ``{"image": ..., "text": ..., "category": ...}``
next to the images; negatives are other captions of the same category. Bad rows raise DataError
naming the file and line.

Batches are dicts of tensors, passed as ``model(**batch)``:
  images (B, 3, 32, 32) float32, captions (B, K, T) int64 (0 = padding),
  target (B,) index of the true caption, category (B,) class, lengths (B, K) caption lengths.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._schema import Config, ConfigError, option
from .model import PAD

UNK = 1
SHAPES = ("circle", "square", "triangle", "diamond", "ring", "cross", "hbar", "vbar")
COLOURS = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.9, 0.1),
    "purple": (0.6, 0.15, 0.75),
    "orange": (1.0, 0.55, 0.0),
    "white": (0.95, 0.95, 0.95),
    "cyan": (0.1, 0.85, 0.9),
}
PATTERNS = ("solid", "striped", "checked", "dotted")
IMAGE_SIZE = 32


class DataError(ValueError):
    """A data file or row is malformed; the message names the file and line."""


@dataclass
class DataConfig(Config):
    """Where the pairs come from and how they look."""

    folder: str = option("", "real-data folder with captions.jsonl and images; empty: synthetic set")
    seed: int = option(0, "seed of the synthetic set (fixed across training seeds)", lo=0)
    n_train: int = option(2048, "synthetic training pairs (proving ground: 2048)", lo=1)
    n_val: int = option(512, "synthetic validation pairs (proving ground: 512)", lo=1)
    val_fraction: float = option(0.2, "share of a folder's rows held out for validation", lo=0.0, hi=0.9)
    negative_share: float = option(
        0.9,
        "share of negative captions among each image's candidates (report: 90%); K = 1/(1-share) candidates",
        lo=0.0,
        hi=0.99,
        lo_open=True,
    )
    length_median: float = option(50.0, "median caption length in tokens (lognormal)", lo=1.0)
    length_sigma: float = option(1.0, "sigma of log caption length (1.0: p90 ~ 180, p99 ~ 500)", lo=0.0)
    min_len: int = option(10, "shortest caption (tokens)", lo=3)
    max_len: int = option(600, "longest caption (tokens); must not exceed model.max_len", lo=3)
    filler_vocab: int = option(300, "distinct filler words in the descriptions", lo=1)
    noise: float = option(0.1, "std of the Gaussian pixel noise", lo=0.0)

    def validate(self) -> None:
        if self.max_len < self.min_len:
            raise ConfigError(f"{self._prefix}max_len: {self.max_len} is below {self._prefix}min_len={self.min_len}")

    @property
    def num_candidates(self) -> int:
        """K: 1 true caption + K-1 negatives."""
        return max(2, round(1.0 / (1.0 - self.negative_share)))


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")


class WordTokenizer:
    """Lower-case word tokenizer with a vocabulary built from the data (0 = pad, 1 = unknown)."""

    def __init__(self, words: Sequence[str]):
        self.itos = ["<pad>", "<unk>"] + list(words)
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    @staticmethod
    def split(text: str) -> list[str]:
        return _WORD.findall(text.lower())

    @classmethod
    def build(cls, texts: Sequence[str]) -> WordTokenizer:
        """Vocabulary: every word of ``texts``, most frequent first (ties alphabetical)."""
        counts: dict[str, int] = {}
        for t in texts:
            for w in cls.split(t):
                counts[w] = counts.get(w, 0) + 1
        return cls(sorted(counts, key=lambda w: (-counts[w], w)))

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(w, UNK) for w in self.split(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.itos[i] for i in ids if i != PAD)

    def __len__(self) -> int:
        return len(self.itos)


# --------------------------------------------------------------------------------------------
# Pair sets
# --------------------------------------------------------------------------------------------


@dataclass
class PairSet:
    """N images, each with K candidate captions (true one at ``target``)."""

    images: torch.Tensor  # (N, 3, 32, 32) float32
    candidates: list[torch.Tensor]  # N x (K, L_i) int64, padded with 0
    lengths: torch.Tensor  # (N, K) int64
    target: torch.Tensor  # (N,) int64
    category: torch.Tensor  # (N,) int64
    texts: list[str]  # N true captions (for inspection)

    def __len__(self) -> int:
        return len(self.candidates)

    @property
    def num_candidates(self) -> int:
        return int(self.lengths.shape[1])

    def collate(self, idx: Sequence[int]) -> dict[str, torch.Tensor]:
        """The batch dict for items ``idx`` (captions padded to the longest in the batch)."""
        idx = list(idx)
        T = max(int(self.lengths[i].max()) for i in idx)
        caps = torch.zeros(len(idx), self.num_candidates, T, dtype=torch.long)
        for j, i in enumerate(idx):
            c = self.candidates[i]
            caps[j, :, : c.shape[1]] = c
        ix = torch.tensor(idx)
        return {
            "images": self.images[ix],
            "captions": caps,
            "target": self.target[ix],
            "category": self.category[ix],
            "lengths": self.lengths[ix],
        }


def filler_words(n: int) -> list[str]:
    """n pronounceable filler words, the same for every seed (none is an attribute word)."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    words, reserved = [], set(SHAPES) | set(COLOURS) | set(PATTERNS)
    for a in cons:
        for b in vows:
            for c in cons:
                for e in vows:
                    w = a + b + c + e
                    if w not in reserved:
                        words.append(w)
                    if len(words) == n:
                        return words
    raise ConfigError(f"data.filler_vocab: at most {len(words)} filler words are available, asked {n}")


def caption_lengths(cfg: DataConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """Lognormal lengths (median, sigma) clipped to [min_len, max_len]."""
    raw = np.exp(rng.normal(math.log(cfg.length_median), cfg.length_sigma, size=n))
    return np.clip(np.round(raw), cfg.min_len, cfg.max_len).astype(np.int64)


def render(shape: int, colour: int, pattern: int, rng: np.random.Generator, noise: float) -> np.ndarray:
    """One product image (3, 32, 32) in [-0.5, 0.5] plus noise."""
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32)
    cy, cx = rng.uniform(12, 20, size=2)
    R = rng.uniform(8, 11)
    dy, dx = yy - cy, xx - cx
    r = np.sqrt(dx**2 + dy**2)
    name = SHAPES[shape]
    if name == "circle":
        m = r < R
    elif name == "square":
        m = np.maximum(abs(dx), abs(dy)) < 0.8 * R
    elif name == "triangle":
        m = (dy > -0.8 * R) & (dy < 0.8 * R) & (abs(dx) < (dy + 0.8 * R) / 2)
    elif name == "diamond":
        m = abs(dx) + abs(dy) < R
    elif name == "ring":
        m = (r < R) & (r > 0.55 * R)
    elif name == "cross":
        m = ((abs(dx) < 0.3 * R) & (abs(dy) < R)) | ((abs(dy) < 0.3 * R) & (abs(dx) < R))
    elif name == "hbar":
        m = (abs(dy) < 0.35 * R) & (abs(dx) < R)
    else:  # vbar
        m = (abs(dx) < 0.35 * R) & (abs(dy) < R)
    kind = PATTERNS[pattern]
    if kind == "solid":
        tex = np.ones_like(r)
    elif kind == "striped":
        tex = ((xx // 2) % 2).astype(np.float32)
    elif kind == "checked":
        tex = (((xx // 3) + (yy // 3)) % 2).astype(np.float32)
    else:  # dotted
        tex = ((xx % 4 < 2) & (yy % 4 < 2)).astype(np.float32)
    tex = 0.35 + 0.65 * tex
    rgb = np.array(list(COLOURS.values())[colour], dtype=np.float32)[:, None, None]
    bg = rng.uniform(0.05, 0.3)
    img = np.where(m[None], rgb * tex[None], bg).astype(np.float32)
    img += rng.normal(0, noise, size=img.shape).astype(np.float32)
    return img - 0.5


def make_synthetic(cfg: DataConfig | None = None) -> tuple[PairSet, PairSet, WordTokenizer]:
    """(train, val, tokenizer), a pure function of ``cfg`` (same cfg -> identical tensors)."""
    cfg = cfg or DataConfig()
    K = cfg.num_candidates
    n_combo = len(COLOURS) * len(PATTERNS)
    if K > n_combo:
        raise ConfigError(
            f"data.negative_share: {cfg.negative_share} asks {K} candidates per image; "
            f"the synthetic set has only {n_combo} colour/pattern variants per category"
        )
    rng = np.random.default_rng(cfg.seed)
    fill = filler_words(cfg.filler_vocab)
    colour_names = list(COLOURS)
    tok = WordTokenizer(list(SHAPES) + colour_names + list(PATTERNS) + fill)
    shape_id = [tok.stoi[w] for w in SHAPES]
    colour_id = [tok.stoi[w] for w in colour_names]
    pattern_id = [tok.stoi[w] for w in PATTERNS]
    fill_ids = np.array([tok.stoi[w] for w in fill])

    def split(n: int) -> PairSet:
        shapes = rng.integers(0, len(SHAPES), n)
        colours = rng.integers(0, len(COLOURS), n)
        patterns = rng.integers(0, len(PATTERNS), n)
        lens = caption_lengths(cfg, n, rng)
        images = np.stack([render(s, c, p, rng, cfg.noise) for s, c, p in zip(shapes, colours, patterns)])
        cands, texts, targets = [], [], []
        for i in range(n):
            L = int(lens[i])
            ids = fill_ids[rng.integers(0, len(fill_ids), L)]
            pos = rng.choice(L, size=3, replace=False)  # where the attribute words go
            ids[pos[0]] = shape_id[shapes[i]]
            ids[pos[1]] = colour_id[colours[i]]
            ids[pos[2]] = pattern_id[patterns[i]]
            true_combo = colours[i] * len(PATTERNS) + patterns[i]
            others = np.delete(np.arange(n_combo), true_combo)
            neg = rng.choice(others, size=K - 1, replace=False)
            rows = np.repeat(ids[None], K, axis=0)
            t = int(rng.integers(0, K))
            combos = np.insert(neg, t, true_combo)
            rows[:, pos[1]] = np.array(colour_id)[combos // len(PATTERNS)]
            rows[:, pos[2]] = np.array(pattern_id)[combos % len(PATTERNS)]
            cands.append(torch.from_numpy(rows.astype(np.int64)))
            texts.append(tok.decode(ids.tolist()))
            targets.append(t)
        return PairSet(
            images=torch.from_numpy(images),
            candidates=cands,
            lengths=torch.from_numpy(np.repeat(lens[:, None], K, axis=1)),
            target=torch.tensor(targets, dtype=torch.long),
            category=torch.from_numpy(shapes.astype(np.int64)),
            texts=texts,
        )

    return split(cfg.n_train), split(cfg.n_val), tok


def load_folder(cfg: DataConfig, max_len: int | None = None) -> tuple[PairSet, PairSet, WordTokenizer, list[str]]:
    """Read ``cfg.folder``/captions.jsonl -> (train, val, tokenizer, category names).

    Each line: {"image": path relative to the folder, "text": non-empty caption, "category": name}.
    A missing or unreadable image, empty text, bad JSON or missing key raises DataError naming the
    line. Captions longer than ``max_len`` tokens are cut. Negatives are other captions of the
    same category (filled from other categories when a category is too small).
    """
    from PIL import Image, UnidentifiedImageError

    root = cfg.folder
    path = os.path.join(root, "captions.jsonl")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no captions.jsonl in data folder {root!r}")
    max_len = max_len or cfg.max_len
    images, texts, cats = [], [], []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected an object with image, text, category")
            for key in ("image", "text", "category"):
                if key not in row:
                    raise DataError(f"{where}: missing key {key!r}")
            text, cat = row["text"], row["category"]
            if not isinstance(text, str) or not WordTokenizer.split(text):
                raise DataError(f"{where}: empty text")
            if not isinstance(cat, (str, int)) or str(cat) == "":
                raise DataError(f"{where}: empty category")
            img_path = os.path.join(root, str(row["image"]))
            if not os.path.isfile(img_path):
                raise DataError(f"{where}: image file {row['image']!r} not found")
            try:
                with Image.open(img_path) as im:
                    im = im.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
                    arr = np.asarray(im, dtype=np.float32) / 255.0 - 0.5
            except (UnidentifiedImageError, OSError) as e:
                raise DataError(f"{where}: image {row['image']!r} is unreadable ({e})") from None
            images.append(arr.transpose(2, 0, 1))
            texts.append(text)
            cats.append(str(cat))
    K = cfg.num_candidates
    if len(texts) < K:
        raise DataError(
            f"{path}: {len(texts)} rows, but data.negative_share={cfg.negative_share} "
            f"needs at least {K} captions per image"
        )
    names = sorted(set(cats))
    cat_ids = np.array([names.index(c) for c in cats])
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(texts))
    n_val = round(len(texts) * cfg.val_fraction)
    val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])
    tok = WordTokenizer.build([texts[i] for i in train_idx])
    encoded = [tok.encode(t)[:max_len] or [UNK] for t in texts]

    def split(idx: list[int]) -> PairSet:
        cands, lens, targets = [], [], []
        for i in idx:
            same = [j for j in range(len(texts)) if j != i and cat_ids[j] == cat_ids[i]]
            other = [j for j in range(len(texts)) if cat_ids[j] != cat_ids[i]]
            rng.shuffle(same)
            rng.shuffle(other)
            neg = (same + other)[: K - 1]
            t = int(rng.integers(0, K))
            rows = [encoded[j] for j in neg]
            rows.insert(t, encoded[i])
            L = max(len(r) for r in rows)
            c = torch.zeros(K, L, dtype=torch.long)
            for r, ids in enumerate(rows):
                c[r, : len(ids)] = torch.tensor(ids)
            cands.append(c)
            lens.append([len(r) for r in rows])
            targets.append(t)
        return PairSet(
            images=torch.from_numpy(np.stack([images[i] for i in idx]))
            if idx
            else torch.zeros(0, 3, IMAGE_SIZE, IMAGE_SIZE),
            candidates=cands,
            lengths=torch.tensor(lens, dtype=torch.long).reshape(len(idx), K),
            target=torch.tensor(targets, dtype=torch.long),
            category=torch.from_numpy(cat_ids[idx].astype(np.int64)) if idx else torch.zeros(0, dtype=torch.long),
            texts=[texts[i] for i in idx],
        )

    return split(train_idx), split(val_idx), tok, names


def build_data(cfg: DataConfig, max_len: int) -> tuple[PairSet, PairSet, int, int]:
    """(train, val, vocab_size, num_classes) from the synthetic set or cfg.folder."""
    if cfg.max_len > max_len and not cfg.folder:
        raise ConfigError(f"data.max_len: {cfg.max_len} exceeds model.max_len={max_len}")
    if cfg.folder:
        train, val, tok, names = load_folder(cfg, max_len)
        return train, val, len(tok), max(2, len(names))
    train, val, tok = make_synthetic(cfg)
    return train, val, len(tok), len(SHAPES)


class BucketedLoader:
    """Length-bucketed micro-batches in a seeded order, reshuffled each epoch.

    Each epoch: shuffle the items, cut them into pools of ``pool`` micro-batches, sort each pool by
    caption length, cut it into micro-batches, shuffle the micro-batches. Iterating yields batch
    dicts. ``rank``/``world`` give each DDP rank every world-th micro-batch (same count on all).
    """

    def __init__(
        self,
        data: PairSet,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        pool: int = 32,
        rank: int = 0,
        world: int = 1,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data, self.batch_size, self.seed, self.shuffle = data, batch_size, seed, shuffle
        self.pool, self.rank, self.world = pool, rank, world
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batch_indices(self) -> list[list[int]]:
        n, bs = len(self.data), self.batch_size
        max_len = self.data.lengths.max(1).values
        if not self.shuffle:
            order = torch.argsort(max_len, stable=True).tolist()
            batches = [order[i : i + bs] for i in range(0, n, bs)]
        else:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            perm = torch.randperm(n, generator=g).tolist()
            batches = []
            step = bs * self.pool
            for s in range(0, n, step):
                chunk = sorted(perm[s : s + step], key=lambda i: int(max_len[i]))
                batches += [chunk[i : i + bs] for i in range(0, len(chunk), bs)]
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        if self.world > 1:
            usable = len(batches) - len(batches) % self.world
            batches = batches[self.rank : usable : self.world]
        return batches

    def __len__(self) -> int:
        return len(self.batch_indices())

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for idx in self.batch_indices():
            yield self.data.collate(idx)
