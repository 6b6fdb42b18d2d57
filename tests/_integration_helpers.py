"""Comparisons the framework-integration tests share (Lightning, transformers)."""

import torch


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def same_state(a, b):
    assert a.keys() == b.keys()
    return all(
        torch.equal(a[k][n], b[k][n]) if torch.is_tensor(a[k][n]) else a[k][n] == b[k][n] for k in a for n in a[k]
    )


def monitor_hooks(opt):
    return list(opt._optimizer_step_pre_hooks.values()) + list(opt._optimizer_step_post_hooks.values())
