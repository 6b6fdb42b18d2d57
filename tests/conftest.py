import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
