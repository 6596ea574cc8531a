"""A model whose every layer attends within a sliding window gives its KV blocks back to the
pool as the window moves past them: a long generation holds about window / block_size
blocks, not its whole length, and generates the same tokens as when it keeps them all; the
prefix cache and the KV bookkeeping stay right. A model with some full-attention layers
(Gemma 2/3) keeps every block."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.actors.engine import Engine
from sluice.actors.executor.loader import read_model_config
from sluice.actors.executor.runner import ModelRunner
from sluice.ipc.vocabulary import SamplingParams

from support.families import SHAPE, VOCAB, save

transformers = pytest.importorskip("transformers")

WINDOW, BLOCK = 12, 4
MOST_HELD = math.ceil(WINDOW / BLOCK) + 1
NEW_TOKENS = 40
PROMPT = [(7 * i + 3) % VOCAB for i in range(30)]
# shares the first 5 blocks of PROMPT, then goes its own way
SHARING = PROMPT[:20] + [(11 * i + 5) % VOCAB for i in range(13)]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral")
    config = transformers.MistralConfig(max_position_embeddings=128, sliding_window=WINDOW,
                                        rope_theta=5000.0, **SHAPE)
    torch.manual_seed(0)
    save(transformers.MistralForCausalLM(config).eval(), folder)
    return ModelRunner(folder, dtype="float32", num_blocks=64, block_size=BLOCK)


def run(engine: Engine, prompts: list[list[int]], *, staggered: bool = False) -> tuple[
        dict[str, list[int]], dict[str, int], dict[str, int]]:
    """Greedy generation of each prompt, the KV invariant checked after every step. Returns
    each request's tokens, the most blocks it held once its prompt was computed, and the
    prompt tokens the prefix cache gave it. `staggered`: each prompt is added once the one
    before it has been computed (so that it can find the blocks of its prefix cached)."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    core = engine.scheduler
    pending = list(prompts)
    tokens: dict[str, list[int]] = {}
    held: dict[str, int] = {}
    cached: dict[str, int] = {}
    while pending or engine.has_unfinished():
        if pending and (not staggered or all(core.requests[rid].output_token_ids
                                             for rid in tokens if rid in core.requests)):
            rid = engine.add_request(prompt_token_ids=pending.pop(0), sampling=greedy)
            tokens[rid], held[rid] = [], 0
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        core.check_invariants()
        for rid, request in core.requests.items():
            cached[rid] = request.num_cached_tokens
            if request.output_token_ids:
                held[rid] = max(held[rid], len(request.held_block_ids))
    assert core.kv_cache.num_used_blocks == 0  # every block back, referenced by no one
    core.check_invariants()
    return tokens, held, cached


def test_an_all_windowed_model_gives_back_the_blocks_behind_its_window(runner,
                                                                      smollm_tokenizer) -> None:
    assert runner.config.kv_window == WINDOW
    keeping = Engine(runner=runner, tokenizer=smollm_tokenizer)
    keeping.scheduler.kv_cache.window = 0  # the same model, every block kept
    expected, kept, _ = run(keeping, [PROMPT, SHARING])
    # the second prompt finds the first one's blocks cached and shares them while both
    # run; the first gives its references back as its window moves on, the second keeps
    # its own until its window passes them
    freeing = Engine(runner=runner, tokenizer=smollm_tokenizer)
    assert freeing.scheduler.kv_cache.window == WINDOW
    tokens, held, cached = run(freeing, [PROMPT, SHARING], staggered=True)
    assert list(tokens.values()) == list(expected.values())
    assert all(len(t) == NEW_TOKENS for t in tokens.values())
    assert max(held.values()) <= MOST_HELD < min(kept.values())
    assert list(cached.values())[1] == 20
    # blocks given back keep their prefix-cache entries: the same prompt again finds them
    again, _, cached = run(freeing, [PROMPT])
    assert list(again.values()) == [expected[next(iter(expected))]]
    assert list(cached.values()) == [28]  # its full blocks but the last token's


def test_a_model_with_full_attention_layers_keeps_its_blocks(tmp_path) -> None:
    """Gemma 2 alternates sliding and full layers: a full layer sees every key."""
    config = transformers.Gemma2Config(sliding_window=WINDOW, **SHAPE)
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # the config alone is read
    ours = read_model_config(tmp_path)
    assert ours.sliding_window == WINDOW and ours.kv_window == 0
