"""A torch.compile'd model: the monitor's forward hooks must not change what dynamo compiles (no
graph break, no recompilation, so ``fullgraph=True`` still compiles), the run stays bit-identical,
and the watch, which cannot see inside compiled code, says so instead of watching nothing.

The eager backend: dynamo traces the model and its hooks as it would for inductor (the guards,
graph breaks and recompilations are dynamo's), without needing a C++ compiler."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sfmonitor


class Attention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))


class TinyGPT(nn.Module):
    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.emb, self.attn = nn.Embedding(vocab, d), Attention(d)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(self.ln(x + self.attn(x)))


def train(monitored, tmp_path, n_steps=12, fullgraph=False):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"console": False, "watch": {"stride": 1}}
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=config) if monitored else None
    compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
    from torch._dynamo.utils import counters

    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps(model, opt, mon, n_steps, forward=compiled)
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    stats = dict(mon.stats) if mon else {}
    if mon:
        mon.detach()
    return model, graphs, breaks, [str(w.message) for w in caught], stats


def steps(model, opt, mon, n, forward=None):
    """``n`` training steps of next-token loss, through the monitor when there is one."""
    for i in range(n):
        x = torch.randint(0, 20, (4, 9), generator=torch.Generator().manual_seed(i))
        run = model if forward is None else forward
        loss = F.cross_entropy(run(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        (mon.combine(loss) if mon else loss).backward()
        opt.step()
        opt.zero_grad()


def attached(model, tmp_path):
    """The model's AdamW and a monitor sampling the watch every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"console": False, "watch": {"stride": 1}}
    return opt, sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=config)


def test_a_compiled_model_compiles_as_without_the_monitor_and_trains_bit_identically(tmp_path):
    bare, bare_graphs, bare_breaks, _, _ = train(False, tmp_path / "bare")
    model, graphs, breaks, _, stats = train(True, tmp_path / "mon")
    assert (graphs, breaks) == (bare_graphs, bare_breaks) == (1, 0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bare.parameters()))
    assert "grad_norm/total" in stats and "loss/total" in stats  # the monitor still measures the step


class Blocks(nn.Module):
    """Identical blocks, each compiled on its own (torchtitan compiles per block under FSDP2)."""

    def __init__(self, vocab=20, d=16, n=3):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), Attention(d)) for _ in range(n))

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_identical_blocks_compiled_one_by_one_share_one_graph_with_the_monitor_too(tmp_path):
    from torch._dynamo.utils import counters

    graphs = []
    for monitored in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Blocks()
        opt, mon = attached(model, tmp_path / str(monitored))
        if not monitored:
            mon.detach()
        for block in model.blocks:
            block.compile(backend="eager")
        steps(model, opt, mon if monitored else None, 4)
        graphs.append(counters["stats"]["unique_graphs"])
        if monitored:
            assert "act_absmax/head" in mon.stats  # what runs outside the compiled blocks is watched
            mon.detach()
    assert graphs[1] == graphs[0] == 1, graphs


def test_the_watch_names_the_attention_modules_it_cannot_see_inside_compiled_blocks(tmp_path):
    torch.manual_seed(0)
    model = Blocks()
    opt, mon = attached(model, tmp_path)
    model.blocks[1].compile(backend="eager")  # blocks 0 and 2 stay eager
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps(model, opt, mon, 4)
    mon.detach()
    said = [str(w.message) for w in caught if "activation watch" in str(w.message)]
    assert len(said) == 1 and "1 of its attention modules (blocks.1.1)" in said[0], said


def test_fullgraph_compilation_still_works_with_the_monitor_attached(tmp_path):
    train(True, tmp_path, n_steps=3, fullgraph=True)


def test_the_watch_says_once_that_it_cannot_see_inside_compiled_code(tmp_path):
    *_, messages, stats = train(True, tmp_path)
    blind = [m for m in messages if "torch.compile" in m and "watch did not see any" in m]
    assert len(blind) == 1, messages
    assert not any(k.startswith(("act_absmax/", "attn_logit_max/")) for k in stats)


def test_the_watch_still_sees_the_same_model_run_eagerly(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    opt, mon = attached(model, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no blindness warning
        steps(model, opt, mon, 3)
    assert "attn_logit_max/attn" in mon.stats
    mon.detach()


if not hasattr(torch, "compile"):  # pragma: no cover - every supported torch has it
    pytest.skip("torch.compile is not available", allow_module_level=True)


def test_an_attention_submodule_a_fused_kernel_replaces_is_no_blind_spot(tmp_path):
    """Hugging Face GPT-2 with SDPA keeps an ``attn_dropout`` it never calls: nothing to say."""
    torch.manual_seed(0)
    model = TinyGPT()
    model.attn.attn_dropout = nn.Dropout(0.0)  # named like attention, never run
    opt, mon = attached(model, tmp_path)
    assert "attn.attn_dropout" in mon._watch.attention  # watched as attention...
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ...and no warning that it did not run
        steps(model, opt, mon, 4)
    mon.detach()


def test_a_compiled_optimizer_step_does_not_trace_the_monitors_hooks(tmp_path):
    """torch.compile(optimizer.step) (PyTorch's "compiling the optimizer" recipe): dynamo traced into
    the monitor's step hooks, broke the graph 26 times in 120 steps on their host reads, clocks and
    RNG captures, compiled new graphs on snapshot steps, and ran ~10x slower than uncompiled. The
    hooks run eagerly (torch.compiler.disable): the graph breaks are the bare compiled step's, and
    the run is bit-identical to it."""
    import torch._dynamo.utils

    def run(monitored):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
        mon = (
            sfmonitor.attach(model, opt, run_dir=str(tmp_path / str(monitored)), config={"console": False})
            if monitored
            else None
        )
        step = torch.compile(opt.step, backend="eager")
        g = torch.Generator().manual_seed(0)
        for _ in range(30):
            x = torch.randn(16, 16, generator=g)
            loss = nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))
            (mon.combine(loss) if mon else loss).backward()
            step()
            opt.zero_grad()
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        if mon:
            assert mon.step == 30 and any(k.startswith("update_ratio/") for k in mon.stats)
            mon.detach()
        return model, breaks

    bare, bare_breaks = run(False)
    model, breaks = run(True)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bare.state_dict().values()))
    assert breaks <= bare_breaks + 2, (breaks, bare_breaks)
