"""Checkpoints: atomic writes survive SIGKILL, unsafe pickles are refused, snapshots restore
bit-exactly (model, Adam state, GradScaler, RNG) and never alias."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sfmonitor.checkpoint import (
    CheckpointError,
    SnapshotRing,
    capture_state,
    load_checkpoint,
    restore_state,
    save_checkpoint,
)

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, steps):
    for _ in range(steps):
        x = torch.randn(16, 6)  # consumes the global RNG, as does dropout
        loss = model(x).pow(2).mean() + float(np.random.rand()) * 0 + random.random() * 0
        opt.zero_grad()
        loss.backward()
        opt.step()


def flat(model, opt):
    out = [t.clone() for t in model.state_dict().values()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_save_load_round_trip_plain_and_atomic_no_leftovers(tmp_path):
    path = tmp_path / "sub" / "ck.pt"
    state = {"w": torch.arange(5.0), "step": 3, "name": "x", "nested": {"l": [1, 2.5, None], "t": (1, 2)}}
    assert save_checkpoint(path, state) == path
    got = load_checkpoint(path)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3 and got["nested"]["l"] == [1, 2.5, None]
    save_checkpoint(path, {"w": torch.zeros(2)})  # overwrite
    assert torch.equal(load_checkpoint(path)["w"], torch.zeros(2))
    assert sorted(p.name for p in path.parent.iterdir()) == ["ck.pt"]  # no temp files left


class NotPlain:
    def __init__(self):
        self.payload = "arbitrary object"


@pytest.mark.parametrize("bad", [print, os.system, NotPlain()], ids=["builtin", "os.system", "object"])
def test_pickled_non_tensor_object_is_refused(tmp_path, bad):
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "bad": bad}, path)
    with pytest.raises(CheckpointError, match="refused.*weights_only=True"):
        load_checkpoint(path)


def test_missing_and_torn_files_raise_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "none.pt")
    good = tmp_path / "good.pt"
    save_checkpoint(good, {"w": torch.ones(1000)})
    torn = tmp_path / "torn.pt"
    torn.write_bytes(good.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(torn)


WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(1)
    from sfmonitor.checkpoint import save_checkpoint
    big = torch.empty(6_000_000)  # 24 MB per checkpoint
    i = 0
    while True:
        i += 1
        big.fill_(float(i))
        save_checkpoint({path!r}, {{"i": i, "big": big}})
        if i == 1:
            print("ready", flush=True)
""")


def test_sigkill_during_write_leaves_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "ck.pt"
    interrupted = 0
    for attempt in range(8):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER.format(repo=str(REPO), path=str(path))], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.05 + 0.037 * attempt)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        tmps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        interrupted += bool(tmps)
        state = load_checkpoint(path)  # the last complete checkpoint, whatever moment the kill hit
        assert state["i"] >= 1
        assert torch.equal(state["big"], torch.full((6_000_000,), float(state["i"])))
        for p in tmps:
            p.unlink()
        if interrupted >= 2:
            break
    assert interrupted >= 1, "the kill never landed mid-write; the test proved nothing"


def test_capture_restore_bit_exact_with_adam_state_and_rng():
    model, opt = make()
    train(model, opt, 5)
    snap = capture_state(model, opt)
    before = flat(model, opt)
    train(model, opt, 3)
    after_a = flat(model, opt)
    assert not same(before, after_a)
    restore_state(snap, model, opt)
    assert same(flat(model, opt), before)
    train(model, opt, 3)  # same RNG draws (dropout, data) and same Adam state -> same result
    assert same(flat(model, opt), after_a)
    # the snapshot was not aliased by the optimizer: restoring again is still exact
    restore_state(snap, model, opt)
    assert same(flat(model, opt), before)


def test_capture_survives_weights_only_round_trip_and_restores_rng(tmp_path):
    model, opt = make(1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    train(model, opt, 2)
    np.random.seed(5)
    random.seed(6)
    state = capture_state(model, opt, scaler, extra={"step": 2, "weights": {"vision": 0.4}})
    draws = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    save_checkpoint(tmp_path / "s.pt", state)
    loaded = load_checkpoint(tmp_path / "s.pt")
    assert loaded["extra"] == {"step": 2, "weights": {"vision": 0.4}}
    model2, opt2 = make(9)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    restore_state(loaded, model2, opt2, scaler2)
    assert same(flat(model2, opt2), flat(model, opt))  # model untouched since the capture
    assert scaler2.state_dict()["scale"] == 1024.0
    assert torch.equal(torch.rand(3), draws[0])
    assert np.array_equal(np.random.rand(3), draws[1])
    assert [random.random() for _ in range(3)] == draws[2]


def test_restore_keeps_current_lr_unless_asked():
    model, opt = make()
    train(model, opt, 1)
    snap = capture_state(model, opt)
    for g in opt.param_groups:
        g["lr"] = 5e-4  # the user's scheduler moved on
    restore_state(snap, model, opt)
    assert all(g["lr"] == 5e-4 for g in opt.param_groups)
    restore_state(snap, model, opt, keep_hyperparams=False)
    assert all(g["lr"] == 1e-2 for g in opt.param_groups)


def test_snapshot_ring_every_keep_latest_before_discard():
    model, opt = make()
    ring = SnapshotRing(every=10, keep=3)
    taken = [s for s in range(0, 61) if ring.maybe_take(s, model, opt)]
    assert taken == [0, 10, 20, 30, 40, 50, 60] and ring.labels == [40, 50, 60]
    assert ring.latest_before(59)[0] == 50 and ring.latest_before(60)[0] == 60
    assert ring.latest_before(39) is None
    ring.discard_after(45)
    assert ring.labels == [40]
    ring.take(40, model, opt)  # same label replaces
    assert ring.labels == [40]
    with pytest.raises(ValueError, match="every"):
        SnapshotRing(every=0)
    # snapshots are CPU copies, independent of later training
    model2, opt2 = make()
    ring2 = SnapshotRing(every=1, keep=2)
    ring2.take(0, model2, opt2)
    w0 = ring2.latest_before(0)[1]["model"]["0.weight"].clone()
    train(model2, opt2, 2)
    assert torch.equal(ring2.latest_before(0)[1]["model"]["0.weight"], w0)


def test_a_snapshot_delayed_by_an_unhealthy_step_is_taken_at_the_next_one():
    model = torch.nn.Linear(2, 1)
    ring = SnapshotRing(every=10, keep=3)
    offered = [0, 1, 2, 11, 12, 25, 30]  # steps 10 and 20-24 were unhealthy: not offered
    taken = [s for s in offered if ring.maybe_take(s, model)]
    assert taken == [0, 11, 25] and ring.labels == [0, 11, 25]


# --------------------------------------------------------------------------------------------
# Corrupt files: any bytes give a result or CheckpointError naming the file, never another error
# --------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _real_checkpoint_bytes() -> bytes:
    import io

    model, opt = make()
    train(model, opt, 1)
    buf = io.BytesIO()
    torch.save({**capture_state(model, opt), "note": "héllo", "steps": [1, 2.5, None]}, buf)
    return buf.getvalue()


REAL = _real_checkpoint_bytes()


def _load_or_typed_error(path):
    try:
        out = load_checkpoint(path)
    except CheckpointError as e:
        assert str(path) in str(e), f"the message does not name the file: {e}"
        return None
    assert isinstance(out, dict)
    return out


def test_checkpoint_error_is_the_one_in_errors_py():
    from sfmonitor.errors import CheckpointError as TypedCheckpointError
    from sfmonitor.errors import SFMonitorError

    assert CheckpointError is TypedCheckpointError and issubclass(CheckpointError, SFMonitorError)


@_FUZZ
@given(data=st.binary(max_size=4096))
@example(data=b"")
@example(data=b"PK\x03\x04")
@example(data=b"\x80\x02}q\x00.")  # a legacy (non-zip) pickle of {}: loads as a dict
def test_any_bytes_load_or_raise_checkpoint_error(tmp_path, data):
    path = tmp_path / "fuzz.pt"
    path.write_bytes(data)
    _load_or_typed_error(path)


@_FUZZ
@given(cut=st.integers(min_value=0, max_value=len(REAL)))
def test_any_truncation_of_a_real_checkpoint(tmp_path, cut):
    path = tmp_path / "cut.pt"
    path.write_bytes(REAL[:cut])
    _load_or_typed_error(path)


@_FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(REAL) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_any_byte_flips_of_a_real_checkpoint(tmp_path, flips):
    data = bytearray(REAL)
    for pos, val in flips:
        data[pos] = val
    path = tmp_path / "flip.pt"
    path.write_bytes(bytes(data))
    _load_or_typed_error(path)


@pytest.mark.parametrize(
    "members",
    [
        {"hello.txt": b"not a checkpoint"},
        {"archive/data.pkl": b"garbage"},
        {"archive/data.pkl": b"\x80\x02}q\x00(X\x01\x00\x00\x00\xffq\x01K\x01u."},  # bad utf-8 key
        {"archive/data.pkl": b"\x80\x02]q\x00(K\x01K\x02e."},  # a list
        {"archive/data.pkl": REAL[:0] + b"\x80\x02cbuiltins\nprint\nq\x00."},  # a callable
    ],
)
def test_a_valid_zip_with_wrong_contents(tmp_path, members):
    import zipfile

    path = tmp_path / "zip.pt"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    with pytest.raises(CheckpointError, match="zip.pt"):
        load_checkpoint(path)


def test_a_folder_or_a_non_dict_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not a file"):
        load_checkpoint(tmp_path)
    path = tmp_path / "list.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match="list"):
        load_checkpoint(path)


# --------------------------------------------------------------------------------------------
# File mode follows the umask; stale temporaries of a killed write are cleaned on the next save
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_checkpoint_mode_follows_the_umask_like_open(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = save_checkpoint(tmp_path / "ck.pt", {"w": torch.ones(2)})
        with open(tmp_path / "plain", "wb"):
            pass
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode == (tmp_path / "plain").stat().st_mode & 0o777


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.skipif(os.name != "posix", reason="pid liveness is checked on POSIX only")
def test_stale_temporaries_of_ours_are_removed_on_the_next_save_and_nothing_else(tmp_path):
    dead = _dead_pid()
    ours_dead = [f".ck.pt.sfmonitor-{dead}-0a1b2c3d.tmp", f".ck-100.pt.sfmonitor-{dead}-ffff0000.tmp"]
    legacy_old = ".ck.pt.k3j4h5g6.tmp"  # tempfile.mkstemp's name, from before; not touched for 2 h
    keep = [
        f".ck.pt.sfmonitor-{os.getpid()}-12345678.tmp",  # a live writer (this process)
        ".ck.pt.a1b2c3d4.tmp",  # legacy name, fresh: maybe a writer of an older version
        "notes.tmp",
        ".hidden",
        "ck.pt.tmp",
        f".ck.pt.sfmonitor-{dead}-0a1b2c3d.tmp.keep",
        f"ck.pt.sfmonitor-{dead}-0a1b2c3d.tmp",  # no leading dot: not ours
        "data.txt",
    ]
    for name in [*ours_dead, legacy_old, *keep]:
        (tmp_path / name).write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(tmp_path / legacy_old, (two_hours_ago, two_hours_ago))
    os.mkdir(tmp_path / f".dir.pt.sfmonitor-{dead}-0a1b2c3d.tmp")  # a folder is never removed
    keep.append(f".dir.pt.sfmonitor-{dead}-0a1b2c3d.tmp")
    save_checkpoint(tmp_path / "ck.pt", {"w": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, "ck.pt"])


def test_the_temporary_file_is_named_for_cleanup(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    save_checkpoint(tmp_path / "ck.pt", {"w": torch.ones(2)})
    import re

    assert len(seen) == 1 and re.fullmatch(rf"\.ck\.pt\.sfmonitor-{os.getpid()}-[0-9a-f]{{8}}\.tmp", seen[0])
