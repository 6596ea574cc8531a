"""End to end: the embedded model decodes the same greedy tokens on the Triton attention path
(run by the CPU interpreter) as on the torch path."""

from sluice.actors.engine import Engine
from sluice.ipc.vocabulary import SamplingParams
from sluice.kernels import attention, cache

# long enough that its KV spans two blocks of 16, short enough for the interpreter
PROMPT = "Write one short sentence about rivers, canal locks, barges and the boats on them:"


def greedy_tokens(engine: Engine) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [completion] = engine.generate([PROMPT], params)
    return completion.token_ids


def test_triton_attention_gives_the_same_greedy_tokens(make_engine, monkeypatch):
    # each path gets its own engine (own KV pool and prefix cache) over the shared weights
    triton_engine, torch_engine = make_engine(), make_engine()
    assert 16 < len(torch_engine.tokenizer.encode(PROMPT)) < 32

    monkeypatch.setenv("SLUICE_ATTENTION", "triton")
    calls = {"attention": 0, "cache": 0}
    for module, name, key in ((attention, "paged_attention", "attention"),
                              (cache, "reshape_and_cache", "cache")):
        def counted(*args, _launch=getattr(module, name), _key=key, **kwargs):
            calls[_key] += 1
            return _launch(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    triton_tokens = greedy_tokens(triton_engine)
    layers = triton_engine.runner.config.num_layers
    assert calls["attention"] >= 8 * layers and calls["cache"] == calls["attention"]

    monkeypatch.setenv("SLUICE_ATTENTION", "torch")
    torch_tokens = greedy_tokens(torch_engine)

    assert len(torch_tokens) == 8
    assert triton_tokens == torch_tokens
