"""Families beyond Llama served by the daemon as the in-process engine runs them: tiny
random-weight Qwen3, Gemma 2 (windowed and soft-capped) and Mixtral folders that transformers
writes, each served by `sluiced serve --model DIR` on its worker, give the engine's float32
greedy tokens (the engine is held to transformers in tests/unit/engine). KV check after."""

from __future__ import annotations

import pytest
import trio

from sluice.actors.engine import Engine
from sluice.ipc.vocabulary import SamplingParams
from sluice.ipc.client import AsyncClient

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    # a window shorter than the prompt, and both soft caps on
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                    attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
}
PROMPT = [(37 * i + 11) % 1000 + 100 for i in range(21)]
NEW_TOKENS = 12
CONFIG = """
[worker]
dtype = "float32"
num_blocks = 64
threads = 1
"""


def write_family(folder, family: str, tokenizer) -> None:
    import torch

    config_class, model_class, options = FAMILIES[family]
    config = getattr(transformers, config_class)(
        vocab_size=tokenizer.backend.get_vocab_size(), **TINY, **options)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_the_daemon_serves_the_engine_s_greedy_tokens(
        family, tmp_path, smollm_tokenizer, daemon_process, drained_and_consistent) -> None:
    folder = tmp_path / family
    write_family(folder, family, smollm_tokenizer)
    engine = Engine(str(folder), dtype="float32", num_blocks=64)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    expected = engine.generate([PROMPT], greedy)[0].token_ids
    engine.scheduler.check_invariants()
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    process, listen, control = daemon_process(
        ["--model", str(folder), "--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    with trio.fail_after(120):
        async with AsyncClient(listen) as client:
            generation = await client.generate(prompt_ids=PROMPT, max_tokens=NEW_TOKENS,
                                               temperature=0.0, ignore_eos=True)
            result = await generation.collect()
        assert result.finish_reason == "length"
        assert list(result.token_ids) == expected
        await drained_and_consistent(control)
