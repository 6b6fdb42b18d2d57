"""Synthetic product pairs, the word tokenizer, the folder loader and the bucketed loader."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from reference_model import ConfigError
from reference_model.data import (
    COLOURS,
    PATTERNS,
    SHAPES,
    BucketedLoader,
    DataConfig,
    DataError,
    WordTokenizer,
    caption_lengths,
    filler_words,
    load_folder,
    make_synthetic,
)

SMALL = dict(n_train=64, n_val=16, filler_vocab=50)


def test_synthetic_set_is_deterministic_per_seed():
    a, av, _ = make_synthetic(DataConfig(**SMALL))
    b, bv, _ = make_synthetic(DataConfig(**SMALL))
    assert torch.equal(a.images, b.images) and torch.equal(av.images, bv.images)
    assert all(torch.equal(x, y) for x, y in zip(a.candidates, b.candidates))
    assert torch.equal(a.target, b.target)
    c, _, _ = make_synthetic(DataConfig(seed=1, **SMALL))
    assert not torch.equal(a.images, c.images)


def test_negative_share_and_hard_negatives():
    train, _, tok = make_synthetic(DataConfig(**SMALL))
    assert train.num_candidates == 10  # 90% negatives: 1 true + 9
    attr = {tok.stoi[w] for w in list(COLOURS) + list(PATTERNS)}
    for i in range(len(train)):
        cands, t = train.candidates[i], int(train.target[i])
        assert len({tuple(r.tolist()) for r in cands}) == 10  # all candidates differ
        true = cands[t]
        assert tok.stoi[SHAPES[int(train.category[i])]] in true.tolist()
        for r in range(10):  # same description, other attributes
            diff = (cands[r] != true).nonzero().flatten().tolist()
            assert all(int(true[j]) in attr for j in diff)
            if r != t:
                assert 1 <= len(diff) <= 2
    share = DataConfig(negative_share=0.75, **SMALL)
    assert make_synthetic(share)[0].num_candidates == 4


def test_caption_lengths_are_heavy_tailed_and_clipped():
    cfg = DataConfig()
    lens = caption_lengths(cfg, 20000, np.random.default_rng(0))
    assert lens.min() >= 10 and lens.max() <= 600
    assert 45 <= np.median(lens) <= 55
    assert np.percentile(lens, 99) > 400 and (lens == 600).any() and (lens <= 15).any()
    train, _, _ = make_synthetic(DataConfig(n_train=256, n_val=8, filler_vocab=50))
    L = train.lengths[:, 0]
    assert int(L.min()) < 20 and int(L.max()) > 250


def test_filler_words_exclude_attribute_words_and_config_is_checked():
    words = filler_words(300)
    assert len(set(words)) == 300
    assert not set(words) & (set(SHAPES) | set(COLOURS) | set(PATTERNS))
    with pytest.raises(ConfigError, match="data.max_len"):
        DataConfig.from_dict({"min_len": 50, "max_len": 20}, prefix="data.")
    with pytest.raises(ConfigError, match="negative_share"):
        make_synthetic(DataConfig(negative_share=0.98, **SMALL))


def test_tokenizer_round_trip():
    tok = WordTokenizer.build(["Red Shirt, red!", "blue shirt"])
    assert tok.itos[:4] == ["<pad>", "<unk>", "red", "shirt"]
    assert tok.decode(tok.encode("red BLUE shirt")) == "red blue shirt"
    assert tok.encode("unknownword") == [1]


def _write_folder(root, rows):
    root.mkdir(exist_ok=True)
    for i in range(12):
        colour = (255, 0, 0) if i % 2 else (0, 0, 255)
        Image.new("RGB", (40, 30), colour).save(root / f"img{i}.png")
    with open(root / "captions.jsonl", "w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def _good_rows():
    return [
        {
            "image": f"img{i}.png",
            "text": f"a {'red' if i % 2 else 'blue'} cotton shirt number {i}",
            "category": "shirt" if i < 6 else "mug",
        }
        for i in range(12)
    ]


def test_folder_loader_reads_images_captions_categories(tmp_path):
    _write_folder(tmp_path, _good_rows())
    cfg = DataConfig(folder=str(tmp_path), negative_share=0.75, val_fraction=0.25)
    train, val, tok, names = load_folder(cfg)
    assert names == ["mug", "shirt"]
    assert len(train) == 9 and len(val) == 3
    assert train.images.shape == (9, 3, 32, 32) and train.num_candidates == 4
    assert float(train.images.max()) <= 0.5 and float(train.images.min()) >= -0.5
    batch = train.collate([0, 1])
    assert batch["captions"].shape[:2] == (2, 4)
    for i in range(len(train)):
        true = train.candidates[i][int(train.target[i])]
        assert tok.decode(true.tolist()) == " ".join(WordTokenizer.split(train.texts[i]))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"image": "missing.png", "text": "a shirt", "category": "shirt"}, "not found"),
        ({"image": "broken.png", "text": "a shirt", "category": "shirt"}, "unreadable"),
        ({"image": "img0.png", "text": "  ", "category": "shirt"}, "empty text"),
        ({"image": "img0.png", "category": "shirt"}, "missing key 'text'"),
        ("{not json", "not valid JSON"),
    ],
)
def test_folder_loader_rejects_bad_rows_naming_the_line(tmp_path, bad, message):
    rows = _good_rows()
    rows.insert(2, bad)
    _write_folder(tmp_path, rows)
    (tmp_path / "broken.png").write_bytes(b"this is not a png")
    with pytest.raises(DataError, match=rf"captions.jsonl:3: .*{message}"):
        load_folder(DataConfig(folder=str(tmp_path), negative_share=0.75))


def test_folder_loader_needs_captions_file_and_enough_rows(tmp_path):
    with pytest.raises(DataError, match="no captions.jsonl"):
        load_folder(DataConfig(folder=str(tmp_path)))
    _write_folder(tmp_path, _good_rows()[:3])
    with pytest.raises(DataError, match="at least 4"):
        load_folder(DataConfig(folder=str(tmp_path), negative_share=0.75))


def test_bucketed_loader_covers_each_item_once_buckets_lengths_and_is_seeded():
    train, _, _ = make_synthetic(DataConfig(n_train=512, n_val=8, filler_vocab=50))
    loader = BucketedLoader(train, 8, seed=3)
    idx = loader.batch_indices()
    assert sorted(i for b in idx for i in b) == list(range(512))
    spread = np.mean([float(train.lengths[b, 0].max() - train.lengths[b, 0].min()) for b in idx])
    assert spread < 0.25 * float(train.lengths[:, 0].max() - train.lengths[:, 0].min())
    assert BucketedLoader(train, 8, seed=3).batch_indices() == idx
    loader.set_epoch(1)
    assert loader.batch_indices() != idx
    r0 = BucketedLoader(train, 8, seed=3, rank=0, world=2).batch_indices()
    r1 = BucketedLoader(train, 8, seed=3, rank=1, world=2).batch_indices()
    assert len(r0) == len(r1) == 32 and not {i for b in r0 for i in b} & {i for b in r1 for i in b}
    batch = next(iter(loader))
    assert set(batch) == {"images", "captions", "target", "category", "lengths"}
    assert batch["captions"].shape[2] == int(batch["lengths"].max())
