"""The deterministic mode: a greedy request gives the same tokens alone, in a batch of 32
others, with its prompt chunked at 16 tokens and with its prefix from the cache — in bfloat16
and in float32. Without the mode those can differ (a near tie flipped by another matmul row
count or attention path); the test only notes whether they did, since on some machines they
happen not to."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from sluice.actors.engine import Engine
from sluice.actors.executor.model import (
    PACKING_ROWS_HINT, LlamaModel, ModelConfig, _tiled_linear, _tiled_packed_linear, packs_weights,
)
from sluice.actors.executor.runner import ModelRunner
from sluice.actors.scheduler import SchedulerConfig
from sluice.actors.scheduler.plan import ScheduledSeq, StepPlan
from sluice.ipc.vocabulary import SamplingParams

# GQA, two layers, a vocabulary of a thousand: small enough to run in seconds
CONFIG = ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
# chunks of 16, 16 and 3; its first 32 tokens are two whole cached blocks. The 3 tokens
# left take another attention path than a whole prompt's, outside the mode
PROMPT_TOKENS = 35
# experts, a sliding window on one layer of two and soft-capped scores: the other code paths
FEATURES = dataclasses.replace(CONFIG, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=64, sliding_window=20,
                               layer_types=("sliding_attention", "full_attention"),
                               attn_softcap=30.0, qk_norm=True)
NEW_TOKENS = 6
OTHERS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts():
    rng = random.Random(7)
    target = [rng.randrange(1, CONFIG.vocab_size) for _ in range(PROMPT_TOKENS)]
    others = [[rng.randrange(1, CONFIG.vocab_size) for _ in range(rng.randrange(2, 12))]
              for _ in range(OTHERS)]
    return target, others


def _ways(runner: ModelRunner, tokenizer) -> dict[str, list[int]]:
    """The target's greedy tokens served four ways, each on a fresh scheduler."""
    target, others = _prompts()

    def engine(**settings) -> Engine:
        runner.reset_kv()
        return Engine(runner=runner, tokenizer=tokenizer,
                      scheduler_config=SchedulerConfig(**settings))

    ways = {}
    alone = engine()
    ways["alone"] = alone.generate([target], GREEDY)[0].token_ids
    alone.scheduler.check_invariants()

    batch = engine()
    ways["in a batch of 33"] = batch.generate([*others[:16], target, *others[16:]],
                                              GREEDY)[OTHERS // 2].token_ids
    batch.scheduler.check_invariants()

    chunked = engine(max_prefill_chunk=16)
    ways["chunked at 16"] = chunked.generate([target], GREEDY)[0].token_ids
    chunked.scheduler.check_invariants()

    cached = engine()
    # the same first 32 tokens, another tail: two whole blocks the target then reuses
    cached.generate([target[:32] + others[0][:8]], SamplingParams(max_tokens=1))
    completion = cached.generate([target], GREEDY)[0]
    assert completion.usage["cached_tokens"] == 32  # the prefix really came from the cache
    ways["prefix cached"] = completion.token_ids
    cached.scheduler.check_invariants()
    return ways


@pytest.mark.parametrize("dtype, packed", [(torch.bfloat16, False), (torch.bfloat16, True),
                                           (torch.float32, False)], ids=["bf16", "bf16-packed",
                                                                         "fp32"])
@pytest.mark.parametrize("shape", [(128, 384), (576, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_row_of_the_tiled_matmul_depends_on_that_row_alone(dtype, packed, shape):
    # what the mode rests on, checked on the machine the suite runs on (first in this file:
    # at torch's own thread count): a row's product is the same bits at every row count and
    # every place in the step, bias or not; with weights packed where a model packs them
    if packed and not packs_weights(torch.device("cpu"), dtype):
        pytest.skip("this CPU has no native bf16: no model packs its weights")
    generator = torch.Generator().manual_seed(1)
    inputs, outputs = shape
    weight = torch.randn(outputs, inputs, generator=generator).to(dtype) * 0.05
    bias = torch.randn(outputs, generator=generator).to(dtype)
    row = torch.randn(1, inputs, generator=generator).to(dtype)
    tiled = _tiled_packed_linear if packed else _tiled_linear
    if packed:
        weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS_HINT)
    for b in (None, bias):
        alone = tiled(row, weight, b)
        for rows in (2, 15, 16, 17, 40, 100, 273):
            for place in {0, rows // 2, rows - 1}:
                x = torch.randn(rows, inputs, generator=generator).to(dtype)
                x[place] = row[0]
                assert torch.equal(tiled(x, weight, b)[place], alone[0]), (rows, place)


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer):
    # one torch thread: this model's matmuls are far too small to share, and on a busy
    # machine two threads waiting on each other take seconds; the mode's promise is per
    # thread count alike
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield smollm_tokenizer
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_tokens_do_not_depend_on_batch_chunking_or_prefix_cache(dtype, tokenizer):
    model = LlamaModel.random(CONFIG, dtype=getattr(torch, dtype), seed=5)
    runner = ModelRunner(model=model, num_blocks=64, block_size=16, deterministic=True)
    ways = _ways(runner, tokenizer)
    assert len(ways["alone"]) == NEW_TOKENS
    assert all(tokens == ways["alone"] for tokens in ways.values()), ways

    if dtype != "bfloat16":
        return
    # the same model with the mode off: a note, not an assertion
    model.use_deterministic(False)
    plain = _ways(ModelRunner(model=model, num_blocks=64, block_size=16, profile_tokens=64),
                  tokenizer)
    differ = [way for way, tokens in plain.items() if tokens != plain["alone"]]
    print(f"\n{dtype} without the deterministic mode: "
          + (f"differs from alone when {', '.join(differ)}" if differ else "no difference seen"))


def _last_logits(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """The logits after the target's prompt, and after one decode token following it, computed
    four ways straight through the runner: a stricter check than tokens (every bit)."""
    target, others = _prompts()
    greedy = SamplingParams(temperature=0.0)
    blocks = [0, 1, 2]  # the target's; the others' lie after them

    def seq(name, tokens, start, table):
        return ScheduledSeq(name, tokens, start, table, True, greedy)

    def decode_alone_and_batched() -> tuple[torch.Tensor, torch.Tensor]:
        decode = seq("t", [5], PROMPT_TOKENS, blocks)
        alone = runner.forward_logits(StepPlan(9, [decode]))[0]
        neighbours = [seq(f"d{i}", [7 + i], 3, [8 + i]) for i in range(OTHERS)]
        batched = runner.forward_logits(StepPlan(10, [*neighbours[:9], decode,
                                                      *neighbours[9:]]))[9]
        return alone, batched

    ways = {}
    runner.reset_kv()
    ways["alone"] = runner.forward_logits(StepPlan(1, [seq("t", target, 0, blocks)]))[0]
    ways["decode alone"], ways["decode among 32 decodes"] = decode_alone_and_batched()

    runner.reset_kv()
    batch = [seq(f"o{i}", p, 0, [4 + i]) for i, p in enumerate(others)]
    ways["in a batch of 33"] = runner.forward_logits(
        StepPlan(2, [*batch[:16], seq("t", target, 0, blocks), *batch[16:]]))[16]

    runner.reset_kv()
    for start in (0, 16, 32):
        logits = runner.forward_logits(
            StepPlan(3, [seq("t", target[start:start + 16], start, blocks)]))
    ways["chunked at 16"] = logits[0]

    runner.reset_kv()  # blocks 0 and 1 written by another prompt with the same 32 tokens
    runner.forward_logits(StepPlan(4, [seq("p", target[:32] + others[0][:8], 0, [0, 1, 3])]))
    ways["prefix cached"] = runner.forward_logits(
        StepPlan(5, [seq("t", target[32:], 32, blocks)]))[0]
    return ways


@pytest.mark.parametrize("dtype, config", [("bfloat16", CONFIG), ("float32", CONFIG),
                                           ("float32", FEATURES)],
                         ids=["bfloat16", "float32", "float32-moe-window-softcap"])
def test_logits_are_bitwise_the_same_however_the_step_is_made(dtype, config, tokenizer):
    model = LlamaModel.random(config, dtype=getattr(torch, dtype), seed=5)
    runner = ModelRunner(model=model, num_blocks=64, block_size=16, deterministic=True)
    ways = _last_logits(runner)
    prompt_ways = {k: v for k, v in ways.items() if not k.startswith("decode")}
    for way, logits in prompt_ways.items():
        assert torch.equal(logits, ways["alone"]), way
    assert torch.equal(ways["decode among 32 decodes"], ways["decode alone"])

    model.use_deterministic(False)
    plain = _last_logits(ModelRunner(model=model, num_blocks=64, block_size=16,
                                     profile_tokens=64))
    differ = [way for way, logits in plain.items() if not way.startswith("decode")
              and not torch.equal(logits, plain["alone"])]
    if not torch.equal(plain["decode among 32 decodes"], plain["decode alone"]):
        differ.append("decoded among 32 decodes")
    print(f"\n{dtype} logits without the deterministic mode: "
          + (f"differ from alone when {', '.join(differ)}" if differ else "no difference seen"))


def test_the_setting_reaches_the_worker_and_a_bad_value_is_named(tmp_path):
    from sluice.actors.executor.actor import Executor, WorkerSpec
    from sluice.daemon.config import ConfigFileError, load_config
    from sluice.daemon.main import _overrides, build_parser

    config = tmp_path / "sluiced.toml"
    config.write_text("[worker]\ndeterministic = true\n")
    spec = load_config(config).worker
    assert spec.deterministic is True
    command = Executor(spec, scheduler=None)._command("ipc:///nowhere")
    assert "--deterministic" in command
    assert "--deterministic" not in Executor(WorkerSpec(), scheduler=None)._command("ipc://x")

    config.write_text('[worker]\ndeterministic = "yes"\n')
    with pytest.raises(ConfigFileError, match="worker.deterministic"):
        load_config(config)
    with pytest.raises(ValueError, match="worker.deterministic: runs on the CPU only"):
        WorkerSpec(deterministic=True, device="cuda")

    flagged = _overrides(build_parser().parse_args(["serve", "--deterministic"]))
    assert flagged["worker.deterministic"] is True
    assert load_config(None, flagged).worker.deterministic is True
    # without the flag the file's setting stands
    assert _overrides(build_parser().parse_args(["serve"]))["worker.deterministic"] is None


def test_an_engine_asked_for_the_mode_refuses_a_runner_without_it(tokenizer):
    runner = ModelRunner(model=LlamaModel.random(CONFIG), num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="runner made without it"):
        Engine(runner=runner, tokenizer=tokenizer, deterministic=True)
