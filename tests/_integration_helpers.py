"""Helpers the framework-integration and distributed tests share."""

import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

# FSDP2 (fully_shard) on the CPU, as these tests run it (gloo), works as on a GPU from torch 2.9 on:
# 2.6's fully_shard records events on torch.cpu.Stream, which has no record_event there (accelerators
# only), and 2.7 and 2.8 sum the gradients over gloo where they average them (2x the unsharded
# model's on two ranks: measured, docs/benchmarks.md, "The torch floor").
TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
needs_fsdp2_on_cpu = pytest.mark.skipif(
    TORCH_VERSION < (2, 9), reason=f"FSDP2 on the CPU needs torch >= 2.9; {torch.__version__}"
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank, world, port, timeout_s=None):
    """This spawned worker in a gloo process group on 127.0.0.1, one thread; ``timeout_s`` bounds
    each collective (a hang fails the test instead of stalling it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    dist.init_process_group("gloo", rank=rank, world_size=world, **({"timeout": timeout} if timeout else {}))


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
    """Leave the process group and end this spawned worker process (exit status 0)."""
    # A barrier first: gloo's worker threads free a finished collective's tensors under the GIL,
    # and a process group destroyed while one of them still does (the DDP reducer drops the last
    # reference from Python, holding the GIL, and joins those threads) deadlocks inside torch.
    # Waiting in a barrier releases the GIL until the earlier collectives are freed.
    # Then the spawned worker ends here, without the interpreter's teardown: the process group
    # lives on in what the worker still holds (an FSDP2 model's device mesh), and gloo's threads
    # joined during finalization abort the process now and then ("terminate called without an
    # active exception", SIGABRT; the mechanism is described in pytorch/pytorch#179291, not merged).
    # Call it last, after saving results.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


VOCAB, SEQ = 32, 8  # the tiny GPT-2 the transformers tests train


class Tokens(torch.utils.data.Dataset):
    """``n`` fixed random token sequences, each its own labels (causal LM)."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
