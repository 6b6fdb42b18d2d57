"""Superfusion model: shapes, the loss dict, module layout, and the real fp16 overflow mechanism."""

import copy

import pytest
import torch

from reference_model import ConfigError
from reference_model.data import BucketedLoader, DataConfig, make_synthetic
from reference_model.model import LOSS_NAMES, Fusion, ModelConfig, build_model

torch.set_num_threads(1)

TINY_DATA = DataConfig(
    n_train=8,
    n_val=4,
    negative_share=0.75,
    length_median=12.0,
    length_sigma=0.5,
    min_len=4,
    max_len=40,
    filler_vocab=40,
)


def tiny_model(**kw):
    _, _, tok = make_synthetic(TINY_DATA)
    return build_model({"vocab_size": len(tok), "d_model": 16, "text_ff": 32, "max_len": 64, **kw})


def tiny_batch():
    train, _, _ = make_synthetic(TINY_DATA)
    return next(iter(BucketedLoader(train, 4, seed=0)))


def test_forward_returns_three_scalar_losses_and_scores():
    torch.manual_seed(0)
    model, batch = tiny_model(), tiny_batch()
    B, K, T = batch["captions"].shape
    assert (B, K) == (4, 4)
    losses = model(**batch)
    assert set(losses) == set(LOSS_NAMES) == {"vision", "text", "fusion"}
    for v in losses.values():
        assert v.ndim == 0 and torch.isfinite(v)
    scores = model.score(**batch)
    assert scores.shape == (B, K)
    sum(losses.values()).backward()
    assert model.fusion.log_tau.grad is not None


def test_top_level_children_are_the_modality_groups():
    model = tiny_model()
    assert [n for n, _ in model.named_children()] == ["vision", "text", "fusion"]
    assert all(isinstance(p, torch.nn.Parameter) for p in model.fusion.parameters())
    assert abs(model.fusion.log_tau.exp().item() - 0.07) < 1e-6  # report: tau init 0.07


def test_build_model_rejects_bad_config():
    with pytest.raises(ConfigError, match="model.nope"):
        build_model({"nope": 1})
    with pytest.raises(ConfigError, match="fusion_heads"):
        build_model({"d_model": 16, "fusion_heads": 3})
    with pytest.raises(TypeError):
        build_model(3)


def test_config_errors_are_value_errors_naming_key_and_range():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match=r"model\.d_model: 4 is out of range; allowed: \[8, inf\]"):
        build_model({"d_model": 4})
    with pytest.raises(ConfigError, match=r"mask_ratio: 0\.95 is out of range; allowed: \[0\.0, 0\.9\]"):
        ModelConfig(mask_ratio=0.95)
    with pytest.raises(ConfigError, match="model.text_layers: expected an integer"):
        build_model({"text_layers": "2"})
    with pytest.raises(ConfigError, match=r"temperature_init: 0\.0 is out of range; allowed: \(0\.0, inf\]"):
        build_model({"temperature_init": 0.0})
    cfg = ModelConfig(d_model=16, fusion_heads=4, text_ff=16)
    assert build_model(cfg.to_dict()).config == cfg  # to_dict / from_dict round trip


def test_qk_init_gain_scales_the_fusion_projections():
    torch.manual_seed(0)
    a = tiny_model()
    torch.manual_seed(0)
    b = tiny_model(qk_init_gain=12.0)
    assert torch.allclose(b.fusion.wq.weight, 12 * a.fusion.wq.weight)
    assert torch.allclose(b.fusion.wk.weight, 12 * a.fusion.wk.weight)
    assert torch.equal(b.fusion.wv.weight, a.fusion.wv.weight)


def _fusion_inputs(length, scale):
    """Correlated token features (sum-pooling grows with length) and grown image tokens."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(64, generator=g)
    text = u + 0.1 * torch.randn(1, 4, length, 64, generator=g)  # (B, K, T, d)
    pad = torch.zeros(1, 4, length, dtype=torch.bool)
    image = scale * torch.randn(1, 16, 64, generator=g)  # (B, P, d)
    return image, text, pad


def test_trap_logits_overflow_fp16_for_long_unnormalised_text_and_stable_do_not():
    torch.manual_seed(0)
    trap = Fusion(ModelConfig(qk_init_gain=12.0)).eval()
    # Scale the image tokens so the exact (fp32) logits of a 600-token caption reach ~2x fp16 max.
    image, text, pad = _fusion_inputs(600, 1.0)
    trap.fp32_attention = True
    trap(image, text, pad)
    scale = 2 * 65504 / float(trap.last_max_logit)
    image = image * scale
    trap(image, text, pad)
    assert float(trap.last_max_logit) > 65504  # exact logits exceed float16's range
    trap.fp32_attention = False
    with torch.autocast("cpu", dtype=torch.float16):
        out = trap(image, text, pad)
    assert torch.isinf(trap.last_max_logit)  # q @ k^T overflowed in fp16 ...
    assert not torch.isfinite(out).all()  # ... and the softmax turned it into NaN

    # The same layer on a short caption (10 tokens): sum-pooled logits 60x smaller, finite.
    short = (image, text[:, :, :10], pad[:, :, :10])
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(trap(*short)).all()

    # Stable setting, same weights: length-normalised + scaled logits stay finite in fp16.
    stable = Fusion(ModelConfig(qk_init_gain=12.0, length_norm=True, scaled_attention=True)).eval()
    stable.load_state_dict(trap.state_dict())
    with torch.autocast("cpu", dtype=torch.float16):
        out = stable(image, text, pad)
    assert torch.isfinite(out).all()
    assert float(stable.last_max_logit) < 65504 / 100

    # The precision fallback: the trap layer with fp32 logits at run time is finite too.
    fallback = copy.deepcopy(trap)
    fallback.fp32_attention = True
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(fallback(image, text, pad)).all()


def test_text_longer_than_max_len_is_rejected():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_len"):
        model.text(torch.ones(1, 65, dtype=torch.long))
