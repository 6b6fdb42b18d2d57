"""Bad input never leaks a raw Python error: corrupt anomaly bundles, duck-typed sinks, packaging.

Each test here was written before its fix and failed against the code it was written for (see
docs/guide.md, "Faults and bad input").
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from sfmonitor.checkpoint import capture_rng_state
from sfmonitor.forensics import BundleError, load_bundle, load_manifest, write_bundle

FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


# --------------------------------------------------------------------------------------------
# 1. corrupt anomaly bundles -> BundleError naming the file, never another exception
# --------------------------------------------------------------------------------------------


def _write_real_bundle(root: str) -> str:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    batch = [
        {
            "args": (torch.randn(2, 4),),
            "kwargs": {"text": torch.randint(0, 5, (2, 6))},
            "autocast": "float16",
            "device": "cpu",
        }
    ]
    return write_bundle(
        root,
        12,
        "nonfinite_loss",
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        batch=batch,
        stats={"loss/total": float("nan"), "grad_norm/total": 3.5},
        event={"step": 12, "kind": "nonfinite_loss", "message": "m", "data": {}},
        rng_state=capture_rng_state(),
        config={"strict": False},
        model_factory="pkg.mod:build",
        model_kwargs={"d": 4},
        loss_weights={"a": 0.4},
    )


# Every bundle of this module, the template and each case's copy, lives under one folder removed
# when the session ends (hypothesis makes hundreds of copies).
_ROOT = tempfile.mkdtemp(prefix="sfm-bundles-")
atexit.register(shutil.rmtree, _ROOT, True)
_TEMPLATE = _write_real_bundle(os.path.join(_ROOT, "template"))
_BUNDLE_FILES = sorted(os.listdir(_TEMPLATE))
_FILE_BYTES = {name: open(os.path.join(_TEMPLATE, name), "rb").read() for name in _BUNDLE_FILES}
_MANIFEST = json.loads(_FILE_BYTES["manifest.json"])


def _copy() -> str:
    dst = os.path.join(tempfile.mkdtemp(prefix="case-", dir=_ROOT), "b")
    shutil.copytree(_TEMPLATE, dst)
    return dst


def _load_or_bundle_error(path: str, culprit: str | None = None):
    try:
        return load_bundle(path)
    except BundleError as e:
        if culprit is not None:
            assert culprit in str(e), f"the message does not name {culprit}: {e}"
        return None
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_the_template_bundle_loads():
    b = load_bundle(_TEMPLATE)
    assert set(_BUNDLE_FILES) >= {
        "manifest.json",
        "model.pt",
        "batch.pt",
        "optimizer.pt",
        "rng.pt",
        "stats.json",
        "event.json",
        "config.json",
    }
    assert b["model_state"] and b["batch"][0]["autocast"] == "float16"


@FUZZ
@given(name=st.sampled_from(_BUNDLE_FILES), data=st.binary(max_size=2048))
@example(name="stats.json", data=b"\xff\xfe")  # invalid UTF-8
@example(name="event.json", data=b"[" * 100000)  # nested deeper than the recursion limit
@example(name="manifest.json", data=b"\xff")
@example(name="batch.pt", data=b"")
def test_any_bytes_in_any_bundle_file(name, data):
    path = _copy()
    with open(os.path.join(path, name), "wb") as fh:
        fh.write(data)
    _load_or_bundle_error(path, culprit=name)


@FUZZ
@given(name=st.sampled_from(_BUNDLE_FILES), frac=st.floats(0.0, 1.0))
def test_any_truncation_of_any_bundle_file(name, frac):
    path = _copy()
    data = _FILE_BYTES[name]
    with open(os.path.join(path, name), "wb") as fh:
        fh.write(data[: int(len(data) * frac)])
    _load_or_bundle_error(path, culprit=name)


def test_a_missing_bundle_file_is_named(tmp_path):
    for name in _BUNDLE_FILES:
        path = _copy()
        os.remove(os.path.join(path, name))
        try:
            with pytest.raises(BundleError, match=name.replace(".", r"\.")):
                load_bundle(path)
        finally:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(
    changes=st.dictionaries(
        st.sampled_from(sorted(_MANIFEST) + ["files.model", "files.batch", "files.stats"]),
        json_values,
        min_size=1,
        max_size=4,
    )
)
@example(changes={"files": ["model.pt"]})
@example(changes={"files.model": 3})
@example(changes={"loss_weights": [1]})
@example(changes={"model_kwargs": "x"})
@example(changes={"files.stats": "model.pt"})  # a tensor file read as JSON
@example(changes={"files.batch": "stats.json"})  # a JSON file read as a tensor file
def test_any_manifest_fields(changes):
    path = _copy()
    manifest = json.loads(json.dumps(_MANIFEST))
    for key, value in changes.items():
        if key.startswith("files."):
            if isinstance(manifest.get("files"), dict):
                manifest["files"][key.split(".", 1)[1]] = value
        else:
            manifest[key] = value
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    out = _load_or_bundle_error(path)
    if out is not None:  # what loads has the shapes replay relies on
        m = out["manifest"]
        assert isinstance(m.get("loss_weights") or {}, dict)
        assert isinstance(m.get("model_kwargs") or {}, dict)
        assert isinstance(out["model_state"], dict)
        assert out["batch"] is None or all(isinstance(mb, dict) for mb in out["batch"])


@FUZZ
@given(manifest=json_values)
def test_any_json_as_manifest(manifest):
    path = _copy()
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    _load_or_bundle_error(path)


@pytest.mark.parametrize(
    "name,value,what",
    [
        ("model.pt", [torch.ones(2)], "model.pt"),
        ("batch.pt", {"args": []}, "batch.pt"),
        ("batch.pt", [{"args": 3}], "batch.pt"),
        ("batch.pt", [{"args": [], "autocast": "print"}], "batch.pt"),
        ("rng.pt", [1, 2], "rng.pt"),
    ],
)
def test_tensor_files_with_the_wrong_shape_are_refused(name, value, what):
    path = _copy()
    torch.save(value, os.path.join(path, name))
    try:
        with pytest.raises(BundleError, match=what.replace(".", r"\.")):
            load_bundle(path)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_load_manifest_on_a_file_or_a_bad_manifest(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(BundleError, match="manifest.json is missing"):
        load_manifest(f)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").mkdir()  # a folder where the manifest should be
    with pytest.raises(BundleError, match="manifest.json"):
        load_manifest(tmp_path / "b")


# --------------------------------------------------------------------------------------------
# 8. packaging: the declared torch floor covers the newest torch API the code calls
# --------------------------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torch API -> the first release that has it (as the code calls it)
VERSION_GATED = {
    "torch.get_autocast_dtype(": (2, 4),  # with a device type
    "torch.amp.GradScaler(": (2, 3),  # the device-generic scaler ("cpu")
    "torch.distributed.fsdp.fully_shard": (2, 6),  # FSDP2's public path
    "from torch.distributed.fsdp import fully_shard": (2, 6),
    "torch.nn.utils.get_total_norm(": (2, 6),
}


def _torch_floor() -> tuple[int, ...]:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    (spec,) = [d for d in deps if d.replace(" ", "").startswith("torch>=")]
    return tuple(int(x) for x in spec.split(">=")[1].split(".")[:2])


def test_the_torch_floor_covers_every_version_gated_api_the_code_calls():
    needed = {}
    for folder in ("sfmonitor", "reference_model"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if name.endswith(".py"):
                    text = open(os.path.join(root, name), encoding="utf-8").read()
                    for api, version in VERSION_GATED.items():
                        if api in text:
                            needed[api] = version
    floor = _torch_floor()
    assert needed, "the scan found none of the version-gated APIs: update VERSION_GATED"
    too_new = {api: v for api, v in needed.items() if v > floor}
    assert not too_new, f"pyproject says torch>={floor} but the code calls {too_new}"
    assert floor >= (2, 6), "the documented floor is torch 2.6 (README, 'Requirements')"


def test_readme_names_the_tested_torch_version():
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    makefile = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
    tested = makefile.split("torch==")[1].split()[0]
    assert f"tested with torch {tested}" in readme


def test_make_test_floor_installs_the_declared_floor():
    """`make test-floor` runs the suite on the torch release pyproject.toml declares as the floor:
    raising one without the other would leave the declared floor untested."""
    makefile = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
    floor_torch = makefile.split("FLOOR_TORCH ?= ")[1].split()[0]
    assert tuple(int(v) for v in floor_torch.split(".")[:2]) == _torch_floor()
    assert "pip install --quiet torch==$(FLOOR_TORCH)" in makefile.split("test-floor:")[1]
