"""Model families and rope scalings load as transformers runs them: tiny random-weight models
that transformers writes, held to its own forward (logits) and greedy generation; scalings
that cannot be matched are refused at load."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sluice.actors.executor.loader import ModelLoadError, read_model_config, resolve_model_path

from support import families
from support.families import (
    GGUF_LAYER_NAMES, GGUF_NAMES, SHAPE, VOCAB, assert_transformers_reads_it_alike,
    llama_cpp_permute, save,
)  # fmt: skip

transformers = pytest.importorskip("transformers")

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


def assert_matches_transformers(reference, folder, tokenizer) -> None:
    """Logits of each prompt and greedy tokens of both prompts batched, through the loader and
    the engine (prefill chunks of 32), equal transformers' for the same folder."""
    families.assert_matches_transformers(reference, folder, tokenizer, PROMPTS,
                                         new_tokens=NEW_TOKENS, chunk=32)


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
    ({"rope_type": "proportional", "factor": 2.0}, r"rope scaling type 'proportional' \("
                                                   r"'rope_\w+\.rope_type'\) is not "
                                                   r"supported \(supported: default, linear, "
                                                   r"dynamic, llama3, yarn, longrope\)"),
    ({"type": "su"}, r"longrope rope scaling needs 'original_max_position_embeddings'"),
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
        if name in GGUF_NAMES:
            writer.add_tensor(GGUF_NAMES[name], values)
            continue
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module == "self_attn.q_proj":
            values = llama_cpp_permute(values, cfg.num_attention_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            values = llama_cpp_permute(values, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{index}.{GGUF_LAYER_NAMES[module]}.{kind}", values)
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
    assert_transformers_reads_it_alike(reference, path, PROMPTS[1])
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
