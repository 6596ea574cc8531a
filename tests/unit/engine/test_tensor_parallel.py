"""Tensor parallel on CPU: a model sharded across rank processes that meet over
torch.distributed (gloo) gives the same float32 greedy tokens as the whole model in one
process; sizes the model cannot be split by are refused before any rank starts."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal

import pytest
import torch

from sluice.actors.engine import Engine
from sluice.actors.executor.loader import load_weights, read_model_config
from sluice.actors.executor.model import LlamaModel
from sluice.actors.executor.runner import ModelRunner
from sluice.actors.executor.tensor_parallel import (
    TensorParallelError,
    check_tensor_parallel,
    greedy,
    greedy_many,
    greedy_tokens,
    shard_weights,
)
from sluice.actors.scheduler import SchedulerConfig
from sluice.ipc.vocabulary import SamplingParams

from support.families import SHAPE, VOCAB, save
from support.near_ties import hf_teacher_forced

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 16
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(37)], [(11 * i + 5) % VOCAB for i in range(9)],
           [(13 * i + 1) % VOCAB for i in range(20)]]

# family -> (config class, model class, options): 2 ranks split each
FAMILIES = {
    # 2 KV heads: one per rank
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # 3 KV heads (6 query heads) and an odd intermediate size: rank 0 holds 2 KV heads, rank 1
    # one, and 48 and 49 intermediate rows (the embedded model splits 2:1 the same way)
    "llama_uneven": ("LlamaConfig", "LlamaForCausalLM",
                     dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                          head_dim=16,
                          intermediate_size=97)),
    # 1 KV head, replicated on both ranks; q/k/v biases split with their rows
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),
    # experts split by their intermediate size, one dense layer, per-head q/k norms
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       head_dim=16, norm_topk_prob=False, mlp_only_layers=[1])),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}
    for family, (config_class, model_class, options) in FAMILIES.items():
        config = getattr(transformers, config_class)(
            max_position_embeddings=128, rope_theta=5000.0, **{**SHAPE, **options})
        torch.manual_seed(0)
        reference = getattr(transformers, model_class)(config).eval()
        if family == "qwen2":  # make the biases matter
            for layer in reference.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
        folder = tmp_path_factory.mktemp(family)
        save(reference, folder)
        made[family] = folder
    return made


def one_process(folder) -> list[list[int]]:
    config, weights = load_weights(folder, torch.float32)
    return greedy_tokens(LlamaModel(config, weights), PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def two_ranks(folders):
    """Each family's greedy tokens from one group of 2 rank processes (started once)."""
    families = list(FAMILIES)
    answers = greedy_many([(folders[f], PROMPTS, NEW_TOKENS) for f in families],
                          tensor_parallel=2)
    assert not multiprocessing.active_children()  # no rank outlives its group
    return dict(zip(families, answers))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_give_the_one_process_greedy_tokens(folders, two_ranks, family):
    assert two_ranks[family] == one_process(folders[family])
    # and each token is transformers' own greedy choice after the same prefix
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folders[family], torch_dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS, two_ranks[family]):
        assert tokens == hf_teacher_forced(reference, prompt, tokens)[0]


def test_engine_with_two_ranks_generates_what_one_process_does(folders, smollm_tokenizer):
    """Engine(tensor_parallel=2): rank 0 in this process, rank 1 a child running the same
    plans (prefill in chunks, batched decodes) on its shard; the tokens are one engine's."""
    greedy_params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    chunks = SchedulerConfig(max_prefill_chunk=16)
    one = Engine(runner=ModelRunner(folders["llama"], dtype="float32", num_blocks=32),
                 tokenizer=smollm_tokenizer, scheduler_config=chunks)
    expected = [c.token_ids for c in one.generate(PROMPTS, greedy_params)]
    one.scheduler.check_invariants()
    engine = Engine(str(folders["llama"]), dtype="float32", num_blocks=32, tensor_parallel=2,
                    tokenizer=smollm_tokenizer, scheduler_config=chunks)
    try:
        assert engine.runner.config.num_heads == 2  # rank 0 holds half the heads
        pids = engine.runner.rank_pids
        assert len(set(pids)) == 2
        assert [c.token_ids for c in engine.generate(PROMPTS, greedy_params)] == expected
        engine.scheduler.check_invariants()
        assert engine.scheduler.kv_cache.num_used_blocks == 0  # nothing left held
        # a rank that is gone is named at the next step, not after the group's timeout
        os.kill(pids[1], signal.SIGKILL)
        engine.runner._followers[0].join(timeout=30)
        with pytest.raises(TensorParallelError, match=r"tensor_parallel rank 1 has exited "
                                                      r"\(code -9\)"):
            engine.generate(PROMPTS[:1], greedy_params)
    finally:
        engine.close()
    assert not multiprocessing.active_children()  # the other rank ended with the engine


def test_shards_put_back_together_are_the_whole_model(folders):
    """Each rank holds its heads' rows of q/k/v (biases with them), its columns of o_proj and
    down, its rows of gate/up and of lm_head; KV heads fewer than ranks are replicated."""
    config, weights = load_weights(folders["qwen2"], torch.float32)
    shards = [shard_weights(config, weights, r, 2) for r in range(2)]
    for shard_config, _ in shards:
        assert (shard_config.num_heads, shard_config.num_kv_heads,
                shard_config.intermediate_size) == (2, 1, SHAPE["intermediate_size"] // 2)
    for name in ("q_proj", "q_bias", "gate_proj", "up_proj"):
        whole = torch.cat([s[f"layers.0.{name}"] for _, s in shards])
        assert torch.equal(whole, weights[f"layers.0.{name}"]), name
    for name in ("o_proj", "down_proj"):
        whole = torch.cat([s[f"layers.0.{name}"] for _, s in shards], dim=1)
        assert torch.equal(whole, weights[f"layers.0.{name}"]), name
    for name in ("k_proj", "v_proj", "k_bias"):  # one KV head: both ranks hold it
        for _, shard in shards:
            assert torch.equal(shard[f"layers.0.{name}"], weights[f"layers.0.{name}"]), name
    lm_head = torch.cat([s["lm_head"] for _, s in shards])
    assert torch.equal(lm_head[:VOCAB], weights["lm_head"])
    assert torch.equal(shards[0][1]["embed"], weights["embed"])
    # tied embeddings: each rank's lm_head is its rows of the (whole, replicated) embedding
    tied = dataclasses.replace(config, tie_word_embeddings=True)
    untied = {k: v for k, v in weights.items() if k != "lm_head"}
    shards = [shard_weights(tied, untied, r, 2)[1] for r in range(2)]
    assert torch.equal(torch.cat([s["lm_head"] for s in shards])[:VOCAB], weights["embed"])
    with pytest.raises(TensorParallelError, match="rank 2 is outside a tensor_parallel group"):
        shard_weights(config, weights, 2, 2)


def test_uneven_shares_cover_the_model_once(folders):
    """KV heads dealt out 2:1 with their query heads, the intermediate rows 48:49; the
    pieces put back together are the whole weights."""
    config, weights = load_weights(folders["llama_uneven"], torch.float32)
    shards = [shard_weights(config, weights, r, 2) for r in range(2)]
    assert [(c.num_heads, c.num_kv_heads, c.intermediate_size) for c, _ in shards] == [
        (4, 2, 48), (2, 1, 49)]
    for name, dim in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("gate_proj", 0),
                      ("o_proj", 1), ("down_proj", 1)):
        whole = torch.cat([s[f"layers.1.{name}"] for _, s in shards], dim=dim)
        assert torch.equal(whole, weights[f"layers.1.{name}"]), name


def test_sizes_that_do_not_split_the_model_are_refused(folders, smollm_path):
    config = read_model_config(folders["llama"])
    with pytest.raises(TensorParallelError, match=r"tensor_parallel = 3 cannot split the "
                                                  r"model's 4 attention heads \(2 KV heads\)"):
        check_tensor_parallel(config, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(TensorParallelError, match="tensor_parallel must be a whole number"):
            check_tensor_parallel(config, bad)
    # the embedded model (SmolLM2-135M) has 9 heads and 3 KV heads: 2 ranks split it 2:1 by
    # KV head, 4 cannot split it, refused before any rank process starts
    with pytest.raises(TensorParallelError, match=r"tensor_parallel = 4 cannot split the "
                                                  r"model's 9 attention heads \(3 KV heads\): "
                                                  r".*must be one of 1, 2, 3, 9\)"):
        greedy(smollm_path, PROMPTS, NEW_TOKENS, tensor_parallel=4)
    assert not multiprocessing.active_children()
    with pytest.raises(TensorParallelError, match=r"token id 300 is outside the model's "
                                                  r"vocabulary \(0..299\)"):
        greedy(folders["llama"], [[1, 300]], NEW_TOKENS, tensor_parallel=2)
    with pytest.raises(TensorParallelError, match="a prompt is empty"):
        greedy(folders["llama"], [[]], NEW_TOKENS, tensor_parallel=2)
    assert not multiprocessing.active_children()
    with pytest.raises(TensorParallelError, match="tensor_parallel = 4 cannot split"):
        Engine(tensor_parallel=4)  # the embedded model
    with pytest.raises(TensorParallelError, match="tensor_parallel must be a whole number"):
        Engine(str(folders["llama"]), tensor_parallel=0)
    assert not multiprocessing.active_children()
