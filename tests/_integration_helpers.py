"""Helpers the framework-integration and distributed tests share."""

import torch
import torch.distributed as dist


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def same_state(a, b):
    assert a.keys() == b.keys()
    return all(
        torch.equal(a[k][n], b[k][n]) if torch.is_tensor(a[k][n]) else a[k][n] == b[k][n] for k in a for n in a[k]
    )


def monitor_hooks(opt):
    return list(opt._optimizer_step_pre_hooks.values()) + list(opt._optimizer_step_post_hooks.values())


def leave_process_group():
    # A barrier first: gloo's worker threads free a finished collective's tensors under the GIL,
    # and a process group destroyed while one of them still does (the DDP reducer drops the last
    # reference from Python, holding the GIL, and joins those threads) deadlocks inside torch.
    # Waiting in a barrier releases the GIL until the earlier collectives are freed.
    dist.barrier()
    dist.destroy_process_group()
