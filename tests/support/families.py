"""Holding a model family to transformers: tiny random-weight models that transformers writes
(`save`), one prompt's logits through a fresh pool (`forward_logits`), and greedy generation
through the loader and the engine checked against transformers' own forward
(`assert_matches_transformers`)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from support.near_ties import hf_teacher_forced

from sluice.actors.engine import Engine
from sluice.actors.executor.model import AttentionInputs, LlamaModel
from sluice.actors.executor.runner import ModelRunner
from sluice.actors.scheduler import SchedulerConfig
from sluice.ipc.vocabulary import SamplingParams

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
             tie_word_embeddings=False)


def save(reference, folder) -> None:
    reference.generation_config.eos_token_id = None  # all tokens, as ignore_eos does
    reference.generation_config.pad_token_id = 0
    reference.save_pretrained(folder)


def forward_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """One prompt's logits, every position, through a fresh pool of blocks of 16."""
    n = len(ids)
    blocks = -(-n // 16)
    pool = model.new_kv_pool(blocks, 16)
    attn = AttentionInputs(slot_mapping=torch.arange(n),
                           block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                           query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                           seq_lens=torch.tensor([n], dtype=torch.int32))
    hidden = model.forward(torch.tensor(ids), torch.arange(n), pool, attn)
    return model.logits(hidden)


def assert_matches_transformers(reference, folder, tokenizer, prompts: list[list[int]], *,
                                new_tokens: int, chunk: int, logits_of: int | None = None,
                                max_model_len: int | None = None) -> None:
    """The logits of the prompts (the first `logits_of` of them; all by default), then
    `new_tokens` greedy tokens of every prompt batched through the loader and the engine
    (prefill in chunks of `chunk`; the runner's max_model_len when given), equal
    transformers' for the same folder; the KV pool is consistent after. Each token is checked
    as transformers' greedy choice given the same prefix, in one forward per prompt."""
    runner = ModelRunner(folder, dtype="float32", num_blocks=32, block_size=16,
                         max_model_len=max_model_len)
    for prompt in prompts[:logits_of]:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner.model, prompt), expected,
                                   atol=1e-4, rtol=1e-4)
    engine = Engine(runner=runner, tokenizer=tokenizer,
                    scheduler_config=SchedulerConfig(max_prefill_chunk=chunk))
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    completions = engine.generate(prompts, greedy)
    engine.scheduler.check_invariants()
    for prompt, completion in zip(prompts, completions):
        assert len(completion.token_ids) == new_tokens
        choices, _ = hf_teacher_forced(reference, prompt, completion.token_ids)
        assert completion.token_ids == choices


# ---- GGUF files, written as llama.cpp's converter writes them -------------------------------

GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
               "output_norm.weight", "lm_head.weight": "output.weight"}
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight, heads: int):
    """llama.cpp's q/k row order for its Llama rotary: each head's two halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(
        1, 2).reshape(weight.shape)


def assert_transformers_reads_it_alike(reference, path, prompt: list[int]) -> None:
    """transformers' own GGUF reader finds the reference's weights in the file: it is laid out
    as llama.cpp lays it out."""
    from_file = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=reference.config,
        dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(from_file(ids).logits, reference(ids).logits)
