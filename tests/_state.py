"""A training state to compare bit for bit: the model's and the optimizer's state dicts."""

from __future__ import annotations

import copy

import torch


def snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_identical(a, b):
    """Two snapshots hold the same tensors, bit for bit, and the same optimizer settings."""
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for pid in oa["state"]:
        for k, v in oa["state"][pid].items():
            w = ob["state"][pid][k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, w), (pid, k)
            else:
                assert v == w, (pid, k)
