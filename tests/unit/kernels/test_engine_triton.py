"""End to end: the embedded model decodes the same greedy tokens on the Triton attention path
(run by the CPU interpreter) as on the torch path."""

import pytest

from sluice.actors.engine import Engine
from sluice.actors.executor.runner import ModelRunner
from sluice.actors.scheduler.plan import SamplingParams
from sluice.kernels import attention, cache

PROMPTS = [
    "The capital of France is",
    "Write one short sentence about rivers, canal locks, barges and the boats that pass through them, please:",
]


@pytest.fixture(scope="module")
def torch_engine():
    return Engine(model=None, dtype="float32")


def fresh_engine_sharing_weights(engine: Engine) -> Engine:
    """Same weights and tokenizer, but its own KV pool and prefix cache."""
    runner = ModelRunner(model=engine.runner.model, num_blocks=engine.runner.num_blocks,
                         block_size=engine.runner.block_size)
    return Engine(runner=runner, tokenizer=engine.tokenizer)


def greedy_tokens(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(PROMPTS, params)]


def test_triton_attention_gives_the_same_greedy_tokens(torch_engine, monkeypatch):
    prompt_lengths = [len(torch_engine.tokenizer.encode(p)) for p in PROMPTS]
    assert min(prompt_lengths) < 16 < max(prompt_lengths)  # one prompt spans two KV blocks

    monkeypatch.setenv("SLUICE_ATTENTION", "triton")
    calls = {"attention": 0, "cache": 0}
    for module, name in ((attention, "paged_attention"), (cache, "reshape_and_cache")):
        launch = getattr(module, name)
        key = "attention" if module is attention else "cache"

        def counted(*args, _launch=launch, _key=key):
            calls[_key] += 1
            return _launch(*args)

        monkeypatch.setattr(module, name, counted)
    triton_tokens = greedy_tokens(fresh_engine_sharing_weights(torch_engine))
    layers = torch_engine.runner.config.num_layers
    assert calls["attention"] >= 8 * layers and calls["cache"] == calls["attention"]

    monkeypatch.setenv("SLUICE_ATTENTION", "torch")
    torch_tokens = greedy_tokens(torch_engine)

    assert [len(t) for t in torch_tokens] == [8, 8]
    assert triton_tokens == torch_tokens
