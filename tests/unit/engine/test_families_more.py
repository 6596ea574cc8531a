"""Phi-3, Gemma 2, Gemma 3 and the mixtures of experts (Mixtral, Qwen3-MoE) load as
transformers runs them: tiny random-weight models that transformers writes, held to its own
logits and to 24 greedy tokens of three prompts batched; what cannot load is refused with the
file, the field and the value."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sluice.actors.engine import Engine
from sluice.actors.executor.loader import ModelLoadError, load_weights, read_model_config
from sluice.actors.executor.model import LlamaModel
from sluice.actors.executor.runner import ModelRunner
from sluice.ipc.vocabulary import SamplingParams

from support import families
from support.near_ties import assert_equal_until_near_tie, hf_teacher_forced
from support.families import (
    GGUF_LAYER_NAMES, GGUF_NAMES, SHAPE, VOCAB, assert_transformers_reads_it_alike, forward_logits,
    llama_cpp_permute, save,
)  # fmt: skip

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(40)], [(11 * i + 5) % VOCAB for i in range(9)],
           [(13 * i + 1) % VOCAB for i in range(23)]]


def assert_matches_transformers(reference, folder, tokenizer) -> None:
    """The first prompt's logits, then 24 greedy tokens of every prompt batched (prefill in
    chunks of 16), equal transformers'; the KV pool is consistent after."""
    families.assert_matches_transformers(reference, folder, tokenizer, PROMPTS,
                                         new_tokens=NEW_TOKENS, chunk=16, logits_of=1)


def build(config_class, model_class, **options):
    config = getattr(transformers, config_class)(max_position_embeddings=128, **{**SHAPE,
                                                                                **options})
    torch.manual_seed(0)
    reference = getattr(transformers, model_class)(config).eval()
    for name, weight in reference.named_parameters():
        if "norm" in name:  # Gemma's start at 0 (its norms add 1): make every norm matter
            torch.nn.init.normal_(weight, mean=0.5, std=0.5)
    return reference


def test_phi3_splits_its_fused_matrices(tmp_path, smollm_tokenizer):
    reference = build("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, rope_theta=5000.0)
    save(reference, tmp_path)
    config, weights = load_weights(tmp_path, torch.float32)
    assert "layers.0.qkv_proj" not in weights and weights["layers.0.v_proj"].shape == (32, 64)
    assert config.sliding_window is None
    assert_matches_transformers(reference, tmp_path, smollm_tokenizer)


def test_gemma2_matches_transformers(tmp_path, smollm_tokenizer):
    # soft caps low enough to bite on these weights; a window shorter than two prompts
    reference = build("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, query_pre_attn_scalar=24,
                      attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                      sliding_window=16, tie_word_embeddings=True)
    save(reference, tmp_path)
    config = read_model_config(tmp_path)
    assert config.layer_types == ("sliding_attention", "full_attention")
    assert (config.hidden_act, config.final_softcap, config.embedding_multiplier) == (
        "gelu_tanh", 3.0, 8.0)
    assert_matches_transformers(reference, tmp_path, smollm_tokenizer)


def test_gemma3_local_and_global_layers_have_their_own_rope(tmp_path, smollm_tokenizer):
    reference = build("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16,
                      query_pre_attn_scalar=16, sliding_window=16,
                      layer_types=["sliding_attention", "full_attention"],
                      rope_parameters={
                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 50000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
    save(reference, tmp_path)
    config = read_model_config(tmp_path)
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling.rope_type) == (
        50000.0, 500.0, "linear")
    assert config.qk_norm and config.norm_plus_one and config.sandwich_norms
    assert_matches_transformers(reference, tmp_path, smollm_tokenizer)


def test_gemma3_image_text_checkpoint_serves_its_language_model(tmp_path):
    """Its text_config leaves most fields to transformers' defaults; its weights sit under
    language_model; the vision tower is not read."""
    text = dict(SHAPE, head_dim=16, sliding_window=16, tie_word_embeddings=True,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4)
    torch.manual_seed(0)
    reference = transformers.Gemma3ForConditionalGeneration(config).eval()
    for name, weight in reference.named_parameters():
        if "norm" in name and "language_model" in name:
            torch.nn.init.normal_(weight, mean=0.5, std=0.5)
    save(reference, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for field in ("max_position_embeddings", "rms_norm_eps", "query_pre_attn_scalar"):
        raw["text_config"].pop(field)  # as Google's own configs leave them out
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, weights = load_weights(tmp_path, torch.float32)
    assert (ours.max_position_embeddings, ours.attention_scale) == (131_072, 256 ** -0.5)
    with torch.no_grad():  # the decoding itself is the text-only checkpoint's test's
        expected = reference(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(forward_logits(LlamaModel(ours, weights), PROMPTS[0]),
                               expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_matches_transformers(tmp_path, smollm_tokenizer, family):
    if family == "mixtral":
        reference = build("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                          num_experts_per_tok=2, rope_theta=5000.0)
    else:  # layer 1 dense, unnormalised top-k weights, experts narrower than the dense MLP
        reference = build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                          norm_topk_prob=False, mlp_only_layers=[1], rope_theta=5000.0)
    save(reference, tmp_path)
    config = read_model_config(tmp_path)
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert [config.is_moe_layer(i) for i in range(2)] == [True, family == "mixtral"]
    assert_matches_transformers(reference, tmp_path, smollm_tokenizer)
    if family == "mixtral":  # one expert's matrix left out
        from safetensors.torch import load_file, save_file

        tensors = load_file(tmp_path / "model.safetensors")
        del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
        save_file(tensors, tmp_path / "model.safetensors")
        with pytest.raises(ModelLoadError, match=r"\(model_type mixtral\): weight "
                                                 r"'layers.1.experts.2.up_proj' is missing"):
            load_weights(tmp_path, torch.float32)


def write_config(folder, **changes) -> None:
    raw = dict(model_type="gemma2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    (folder / "config.json").write_text(json.dumps({**raw, **changes}))
    (folder / "model.safetensors").write_bytes(b"")  # the config is refused before weights


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="phi3", rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                           "long_factor": [2.0] * 8}),
     r"longrope rope scaling needs 'original_max_position_embeddings'"),
    (dict(model_type="gemma"), r"model_type 'gemma' is not supported \(supported: .*phi3, "
                               r"gemma2, gemma3_text, mixtral, qwen3_moe\)"),
    (dict(hidden_activation="gelu"), r"hidden_activation 'gelu' is not supported"),
    (dict(model_type="llama", hidden_act="relu"), r"hidden_act 'relu' is not supported"),
    (dict(layer_types=["sliding_attention"]), r"layer_types must list 2 values"),
    (dict(final_logit_softcapping=-1.0), r"final_logit_softcapping is -1.0: it must be"),
    (dict(model_type="mixtral", num_local_experts=2, num_experts_per_tok=3),
     r"num_experts_per_tok 3 is more than the 2 experts"),
    (dict(model_type="qwen3_moe", num_experts=0, num_experts_per_tok=1,
          moe_intermediate_size=8), r"num_experts must be a positive integer, got 0"),
])
def test_a_config_that_cannot_load_is_refused(tmp_path, changes, message):
    write_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=message) as refused:
        read_model_config(tmp_path)
    assert "config.json" in str(refused.value) and "\n" not in str(refused.value)


def test_missing_and_misshapen_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    reference = build("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)
    save(reference, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file({**tensors, "model.layers.1.self_attn.qkv_proj.weight": qkv[1:]},
              tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.safetensors: model.layers.1.self_attn."
                                             r"qkv_proj.weight has shape \(127, 64\), the "
                                             r"config gives \(128, 64\)"):
        load_weights(tmp_path, torch.float32)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"\(model_type phi3\): weight 'model.layers.1.mlp."
                                             r"down_proj.weight' \(ours 'layers.1.down_proj'\) "
                                             r"is missing \(1 of 21 missing\)"):
        load_weights(tmp_path, torch.float32)


# ---- GGUF files, written as llama.cpp's converter writes them -------------------------------

_GGUF_FUSED_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
                     "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
_GGUF_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def write_family_gguf(folder, path, arch: str) -> None:
    """The folder's model as llama.cpp's converter writes it: q/k rows permuted for "llama",
    each layer's experts stacked into one [experts, rows, columns] tensor per matrix, Gemma's
    norm weights stored as 1 + w with its soft caps and window in the metadata, Phi-3's longrope
    factors as two tensors with the attention factor in the metadata."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file


    cfg = json.loads((folder / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    writer = GGUFWriter(str(path), arch)
    for key, value in (("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]),
                       ("block_count", cfg["num_hidden_layers"]),
                       ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("rope.dimension_count", head_dim), ("vocab_size", cfg["vocab_size"])):
        writer.add_uint32(f"{arch}.{key}", value)
    rope = cfg["rope_parameters"].get("full_attention", cfg["rope_parameters"])
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    if rope["rope_type"] == "longrope":  # Phi-3 128k: its factors as tensors, no scaling type
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", float(
            np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
        for name in ("long", "short"):
            writer.add_tensor(f"rope_factors_{name}.weight",
                              np.array(rope[f"{name}_factor"], dtype="float32"))
    gemma = arch.startswith("gemma")
    if gemma:
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                writer.add_float32(f"{arch}.{key}", cfg[key])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if experts:
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    stacked: dict[str, list] = {}
    for name, tensor in sorted(load_file(folder / "model.safetensors").items()):
        values = tensor.numpy().astype("float32")
        if gemma and name.endswith("norm.weight"):
            values = values + 1
        if name in GGUF_NAMES:
            writer.add_tensor(GGUF_NAMES[name], values)
            continue
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if ".experts." in module:
            _, expert, matrix = module.rsplit(".", 2)
            stacked.setdefault(f"blk.{index}.{_GGUF_EXPERTS[matrix]}.{kind}", []).append(
                (int(expert), values))
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            values = llama_cpp_permute(values, heads if "q_proj" in module else kv_heads)
        gguf_module = ((gemma and _GGUF_GEMMA_NORMS.get(module)) or _GGUF_FUSED_NAMES.get(module)
                       or GGUF_LAYER_NAMES[module])
        writer.add_tensor(f"blk.{index}.{gguf_module}.{kind}", values)
    for name, parts in stacked.items():
        writer.add_tensor(name, np.stack([values for _, values in sorted(parts)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["phi3", "qwen3moe", "llama"])
def test_gguf_phi3_and_experts_match_transformers(tmp_path, arch):
    """Phi-3 and Qwen3-MoE by their llama.cpp names, Mixtral as llama.cpp's "llama" with
    experts: the logits equal transformers' (the decoding itself is the folders' tests');
    transformers' own GGUF reader finds the same weights where it reads the architecture."""
    if arch == "phi3":
        reference = build("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, rope_theta=5000.0)
    elif arch == "qwen3moe":
        reference = build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                          norm_topk_prob=True, rope_theta=5000.0)
    else:
        reference = build("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                          num_experts_per_tok=2, rope_theta=5000.0)
    folder = tmp_path / "hf"
    save(reference, folder)
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(folder, path, arch)
    if arch != "llama":
        assert_transformers_reads_it_alike(reference, path, PROMPTS[0])
    config, weights = load_weights(path, torch.float32)
    assert config.num_experts == (0 if arch == "phi3" else 4)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(forward_logits(LlamaModel(config, weights), PROMPTS[0]),
                               expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gguf_gemma_matches_transformers(tmp_path, arch):
    """llama.cpp's Gemma: norms stored as 1 + w, the layer pattern and the local rope base
    fixed by the architecture, the attention scale by the head size (these are not 27B)."""
    if arch == "gemma2":
        reference = build("Gemma2Config", "Gemma2ForCausalLM", head_dim=16,
                          query_pre_attn_scalar=16, attn_logit_softcapping=1.0,
                          final_logit_softcapping=3.0, sliding_window=16,
                          tie_word_embeddings=True)
    else:  # six layers: five sliding, then one full with its own rope base and scaling
        reference = build("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16,
                          query_pre_attn_scalar=16, sliding_window=16, num_hidden_layers=6,
                          rope_parameters={
                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 50000.0},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 10000.0}})
    folder = tmp_path / "hf"
    save(reference, folder)
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(folder, path, arch)
    assert_transformers_reads_it_alike(reference, path, PROMPTS[0])
    config, weights = load_weights(path, torch.float32)
    assert config.layer_types == read_model_config(folder).layer_types
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(forward_logits(LlamaModel(config, weights), PROMPTS[0]),
                               expected, atol=1e-4, rtol=1e-4)


def test_gguf_that_cannot_load_is_refused(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "model.gguf"
    for arch, extra, message in (
            ("gemma", {}, r"architecture 'gemma' \('general.architecture'\) is not supported "
                          r"\(supported: llama, qwen2, qwen3, mistral, phi3, qwen3moe, "
                          r"gemma2, gemma3\)"),
            ("qwen3moe", {"expert_count": 4, "expert_used_count": 5},
             r"'qwen3moe.expert_used_count' is 5: it must be from 1 to "
             r"'qwen3moe.expert_count' \(4\)")):
        writer = GGUFWriter(str(path), arch)
        for key, value in dict(context_length=64, embedding_length=64, block_count=1,
                               feed_forward_length=96, **{"attention.head_count": 4},
                               vocab_size=VOCAB, **extra).items():
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ModelLoadError, match=message) as refused:
            read_model_config(path)
        assert "model.gguf" in str(refused.value)


BF16_FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                    final_logit_softcapping=30.0, sliding_window=16,
                    tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=5000.0)),
}


@pytest.mark.parametrize("family", list(BF16_FAMILIES))
def test_bf16_greedy_matches_transformers_bf16_until_a_near_tie(tmp_path, smollm_tokenizer,
                                                                 family):
    """In bfloat16 the two agree up to the first position where transformers' own top two
    are within bf16's resolution (`support.near_ties`), never differ before it."""
    config_class, model_class, options = BF16_FAMILIES[family]
    reference = build(config_class, model_class, **options)
    save(reference, tmp_path)
    engine = Engine(runner=ModelRunner(tmp_path, dtype="bfloat16", num_blocks=32, block_size=16),
                    tokenizer=smollm_tokenizer)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    completions = engine.generate(PROMPTS, greedy)
    engine.scheduler.check_invariants()
    reference = reference.to(torch.bfloat16)
    compared = [assert_equal_until_near_tie(c.token_ids,
                                            *hf_teacher_forced(reference, prompt, c.token_ids),
                                            torch.bfloat16)
                for prompt, c in zip(PROMPTS, completions)]
    # not only near ties: at least one prompt is compared over half its tokens (measured:
    # Gemma 2 22, 15 and 5 of 24; Mixtral 0, 14 and 1)
    assert max(compared) >= NEW_TOKENS // 2, compared
