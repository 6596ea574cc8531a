"""Kernel tests run Triton's CPU interpreter; it must be chosen before triton is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)
