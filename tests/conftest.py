"""Fixtures shared by every test folder: the embedded model loaded once per session, an
engine factory that checks the KV invariant after each test that used it, and (from the
`support.fixtures` plugin) every daemon fixture, so no folder loads another's conftest."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The repository's folders are installed as `sluice.<folder>`, but `python -m pytest` run from
# the repository root also puts the root itself on sys.path, where `kernels/` would shadow the
# PyPI `kernels` package that transformers imports (and `daemon/`, `ipc/` any package of that
# name). Nothing is imported from the root by its bare name, so it leaves sys.path.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

pytest_plugins = ["support.fixtures"]

if not torch.cuda.is_available():
    # without a GPU Triton kernels only run in its interpreter, which must be chosen before
    # triton is first imported by any test module
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """A test that runs a command in-process configures structlog for the whole process, its
    level with it: put it back, or a later test that captures logs misses every info event
    (one waited for "request ended" until it timed out)."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def smollm_path():
    from sluice.actors.executor.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def smollm_model(smollm_path):
    from sluice.actors.executor.loader import load_weights
    from sluice.actors.executor.model import LlamaModel

    config, weights = load_weights(smollm_path, torch.float32)
    return LlamaModel(config, weights)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path):
    from sluice.actors.text import load_tokenizer

    return load_tokenizer(smollm_path)


@pytest.fixture
def make_engine(smollm_model, smollm_path, smollm_tokenizer):
    """make_engine(num_blocks=..., **scheduler settings) -> Engine on the shared weights.

    At teardown every engine made must pass the KV invariant: consistent block table, and
    each live request holding exactly ceil(computed tokens / block size) blocks.
    """
    from sluice.actors.engine import Engine
    from sluice.actors.executor.runner import ModelRunner
    from sluice.actors.scheduler import SchedulerConfig

    engines = []

    def make(num_blocks: int = 256, **settings):
        runner = ModelRunner(model=smollm_model, model_path=smollm_path, num_blocks=num_blocks,
                             block_size=settings.get("block_size", 16))
        engine = Engine(runner=runner, tokenizer=smollm_tokenizer,
                        scheduler_config=SchedulerConfig(**settings))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.scheduler.check_invariants()
