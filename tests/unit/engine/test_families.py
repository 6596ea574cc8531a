"""Model families and rope scalings load as transformers runs them: tiny random-weight models
that transformers writes, held to its own forward (logits) and greedy generation; scalings
that cannot be matched are refused at load."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sluice.actors.engine import Engine
from sluice.actors.executor.loader import ModelLoadError, read_model_config, resolve_model_path
from sluice.actors.executor.runner import ModelRunner
from sluice.actors.scheduler import SchedulerConfig
from sluice.actors.scheduler.plan import SamplingParams

from test_loader import forward_logits  # one prompt's logits through a fresh pool

transformers = pytest.importorskip("transformers")

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
NEW_TOKENS = 8
# past every scaling's original context (32), and prefilled in chunks of 32 below
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(64)], [(11 * i + 5) % VOCAB for i in range(41)]]

# name -> (rope scaling as transformers takes it, max_position_embeddings)
ROPE_SCALINGS = {
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, 128),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 128),
    # dynamic NTK only moves past max_position_embeddings: served right up to it
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 64 + NEW_TOKENS),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
    "yarn-tuned": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                    "beta_fast": 8, "beta_slow": 2, "attention_factor": 1.3}, 128),
}


def save(reference, folder) -> None:
    reference.generation_config.eos_token_id = None  # all tokens, as ignore_eos does
    reference.generation_config.pad_token_id = 0
    reference.save_pretrained(folder)


def hf_greedy(reference, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def assert_matches_transformers(reference, folder, tokenizer) -> None:
    """Logits of each prompt and greedy tokens of both prompts batched, through the loader and
    the engine (prefill chunks of 32), equal transformers' for the same folder."""
    runner = ModelRunner(folder, dtype="float32", num_blocks=32, block_size=16)
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner.model, prompt), expected,
                                   atol=1e-4, rtol=1e-4)
    engine = Engine(runner=runner, tokenizer=tokenizer,
                    scheduler_config=SchedulerConfig(max_prefill_chunk=32))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    completions = engine.generate(PROMPTS, greedy)
    engine.scheduler.check_invariants()
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.token_ids == hf_greedy(reference, prompt)


def llama(rope_scaling: dict | None, max_positions: int, **extra):
    config = transformers.LlamaConfig(rope_theta=5000.0, max_position_embeddings=max_positions,
                                      rope_scaling=rope_scaling, **SHAPE, **extra)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("name", list(ROPE_SCALINGS))
def test_llama_rope_scaling_matches_transformers(tmp_path, smollm_tokenizer, name):
    rope_scaling, max_positions = ROPE_SCALINGS[name]
    reference = llama(dict(rope_scaling), max_positions)
    save(reference, tmp_path)
    config = read_model_config(resolve_model_path(tmp_path))
    assert config.rope_scaling.rope_type == rope_scaling["rope_type"]
    assert_matches_transformers(reference, tmp_path, smollm_tokenizer)


def test_older_rope_scaling_spelling_reads_the_same(tmp_path, smollm_tokenizer):
    """`rope_scaling` with `type` and a top-level rope_theta, as older transformers wrote it."""
    reference = llama({"rope_type": "linear", "factor": 4.0}, 128)
    save(reference, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = read_model_config(tmp_path)
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 4.0)
    assert config.rope_theta == 5000.0
    assert_matches_transformers(reference, tmp_path, smollm_tokenizer)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_matches_transformers(tmp_path, smollm_tokenizer, tied):
    # head_dim 24 is not hidden / heads (16): Qwen3 sizes heads on their own
    config = transformers.Qwen3Config(rope_theta=5000.0, max_position_embeddings=128,
                                      head_dim=24, **{**SHAPE, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    reference = transformers.Qwen3ForCausalLM(config).eval()
    for layer in reference.model.layers:  # make the q/k norms matter
        torch.nn.init.normal_(layer.self_attn.q_norm.weight, mean=1.0, std=0.5)
        torch.nn.init.normal_(layer.self_attn.k_norm.weight, mean=1.0, std=0.5)
    save(reference, tmp_path)
    ours = read_model_config(tmp_path)
    assert (ours.head_dim, ours.qk_norm, ours.qkv_bias, ours.tie_word_embeddings) == (
        24, True, False, tied)
    assert_matches_transformers(reference, tmp_path, smollm_tokenizer)


def write_config(folder, **changes) -> None:
    raw = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    (folder / "config.json").write_text(json.dumps({**raw, **changes}))
    (folder / "model.safetensors").write_bytes(b"")  # the config is refused before weights


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "factor": 2.0}, r"rope scaling type 'longrope' is not supported "
                                               r"\(supported: default, linear, dynamic, llama3, "
                                               r"yarn\)"),
    ({"type": "su"}, r"rope scaling type 'su' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, r"llama3 rope scaling needs 'low_freq_factor'"),
    ({"rope_type": "linear", "factor": "4"}, r"rope scaling factor is '4': it must be a positive"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     r"partial_rotary_factor 0.5 is not supported"),
])
def test_rope_scaling_that_cannot_be_matched_is_refused(tmp_path, rope, message):
    for field in ("rope_scaling", "rope_parameters"):
        write_config(tmp_path, **{field: rope})
        with pytest.raises(ModelLoadError, match=message) as refused:
            read_model_config(tmp_path)
        assert "config.json" in str(refused.value) and "\n" not in str(refused.value)


def test_a_sliding_window_applies_past_its_length(tmp_path, smollm_tokenizer):
    """Prompts longer than the window, prefilled in chunks past it: each query sees only the
    window's keys, as transformers computes it; the context is not cut to the window."""
    config = transformers.MistralConfig(max_position_embeddings=128, sliding_window=16,
                                        rope_theta=5000.0, **SHAPE)
    torch.manual_seed(0)
    reference = transformers.MistralForCausalLM(config).eval()
    save(reference, tmp_path)
    ours = read_model_config(resolve_model_path(tmp_path))
    assert (ours.sliding_window, ours.max_context) == (16, 128)
    assert_matches_transformers(reference, tmp_path, smollm_tokenizer)
    for qwen, window in ((dict(use_sliding_window=False), None),
                         (dict(use_sliding_window=True), 24)):  # Qwen's only when it says so
        write_config(tmp_path, model_type="qwen2", sliding_window=24, **qwen)
        assert read_model_config(tmp_path).sliding_window == window


def test_unknown_model_type_names_the_supported_ones(tmp_path):
    write_config(tmp_path, model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"'gpt2' is not supported \(supported: llama, "
                                             r"qwen2, qwen3, mistral, phi3"):
        read_model_config(tmp_path)


# ---- GGUF files, written as llama.cpp's converter writes them -------------------------------

_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
               "output_norm.weight", "lm_head.weight": "output.weight"}
_GGUF_LAYER_NAMES = {
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


def write_gguf(reference, path, arch: str, scaling: dict | None = None, rope_freqs=None) -> None:
    from gguf import GGUFWriter

    cfg = reference.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for key, value in (scaling or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_float32)(
            f"{arch}.rope.scaling.{key}", value)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype("float32"))
    for name, tensor in reference.state_dict().items():
        values = tensor.numpy().astype("float32")
        if name in _GGUF_NAMES:
            writer.add_tensor(_GGUF_NAMES[name], values)
            continue
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module == "self_attn.q_proj":
            values = llama_cpp_permute(values, cfg.num_attention_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            values = llama_cpp_permute(values, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{index}.{_GGUF_LAYER_NAMES[module]}.{kind}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_llama3_divisors(head_dim: int, theta: float, rope: dict) -> torch.Tensor:
    """The `rope_freqs` tensor llama.cpp's converter writes for Llama 3 scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old_context = rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(rope["factor"])
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return torch.tensor(divisors)


def assert_transformers_reads_it_alike(reference, path) -> None:
    """transformers' own GGUF reader finds the reference's weights in the file: it is laid out
    as llama.cpp lays it out."""
    from_file = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=reference.config,
        dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(from_file(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_matches_transformers(tmp_path, smollm_tokenizer, arch):
    """llama.cpp keeps Qwen's q/k rows in their own order (only Llama's are permuted)."""
    if arch == "qwen3":
        config = transformers.Qwen3Config(rope_theta=5000.0, max_position_embeddings=128,
                                          head_dim=24, **SHAPE)
    else:
        config = transformers.Qwen2Config(rope_theta=5000.0, max_position_embeddings=128,
                                          **SHAPE)
    torch.manual_seed(0)
    reference = getattr(transformers, f"{arch.capitalize()}ForCausalLM")(config).eval()
    for name, weight in reference.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight", "proj.bias")):
            torch.nn.init.normal_(weight, mean=1.0, std=0.5)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(reference, path, arch)
    assert_transformers_reads_it_alike(reference, path)
    ours = read_model_config(path)
    assert (ours.qk_norm, ours.qkv_bias) == (arch == "qwen3", arch == "qwen2")
    assert_matches_transformers(reference, path, smollm_tokenizer)


GGUF_SCALINGS = {  # transformers' scaling -> the metadata llama.cpp writes for it
    "linear": {"type": "linear", "factor": 4.0},
    "yarn": {"type": "yarn", "factor": 4.0, "original_context_length": 32},
    "llama3": None,  # a rope_freqs tensor instead
}


@pytest.mark.parametrize("name", list(GGUF_SCALINGS))
def test_llama_gguf_rope_scaling_matches_transformers(tmp_path, smollm_tokenizer, name):
    rope_scaling, max_positions = ROPE_SCALINGS[name]
    reference = llama(dict(rope_scaling), max_positions)
    path = tmp_path / "llama.gguf"
    divisors = (llama_cpp_llama3_divisors(16, 5000.0, rope_scaling) if name == "llama3"
                else None)
    write_gguf(reference, path, "llama", GGUF_SCALINGS[name], rope_freqs=divisors)
    assert read_model_config(path).rope_scaling.rope_type == (
        "frequency_divisors" if name == "llama3" else name)
    assert_matches_transformers(reference, path, smollm_tokenizer)


@pytest.mark.parametrize("scaling, rope_freqs, message", [
    ({"type": "longrope", "factor": 4.0}, None,
     r"rope scaling type 'longrope' \('llama.rope.scaling.type'\) is not supported "
     r"\(supported: none, linear, yarn, and Llama 3 frequency factors\)"),
    ({"type": "yarn", "factor": 4.0, "original_context_length": 32, "attn_factor": 0.5}, None,
     r"'llama.rope.scaling.attn_factor' = 0.5 is not supported with yarn"),
    ({"type": "yarn", "factor": 4.0}, None,
     r"yarn rope scaling without 'llama.rope.scaling.original_context_length'"),
    ({"type": "linear", "factor": 2.0}, torch.ones(8),
     r"rope scaling type 'linear' together with a rope_freqs tensor is not supported"),
    (None, torch.ones(5), r"rope_freqs.weight must hold 8 positive values \(one per rotary "
                          r"pair\), it holds 5"),
])
def test_gguf_rope_scaling_that_cannot_be_matched_is_refused(tmp_path, scaling, rope_freqs,
                                                             message):
    reference = llama(None, 128)
    path = tmp_path / "llama.gguf"
    write_gguf(reference, path, "llama", scaling, rope_freqs=rope_freqs)
    with pytest.raises(ModelLoadError, match=message) as refused:
        read_model_config(path)
    assert "llama.gguf" in str(refused.value) and "\n" not in str(refused.value)
