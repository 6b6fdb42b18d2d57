import os

import pytest
import torch

from sfmonitor import registry

torch.set_num_threads(1)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _seed_and_scratch_dir(tmp_path, monkeypatch):
    """Each test starts from seed 0 in its own working directory, so a monitor attached without
    a run_dir (it then writes under ./sfmonitor_runs/) leaves nothing in the checkout."""
    torch.manual_seed(0)
    monkeypatch.chdir(tmp_path)
    yield


@pytest.fixture
def clean_registry():
    """Registrations made by a test are removed after it."""
    saved = {t: dict(getattr(registry, t)) for t in ("KINDS", "ACTIONS", "DETECTORS")}
    yield
    for t, table in saved.items():
        getattr(registry, t).clear()
        getattr(registry, t).update(table)
