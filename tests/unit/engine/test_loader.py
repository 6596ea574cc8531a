"""Loading models: Hugging Face folders (Llama, Qwen2 with qkv bias), GGUF files, bad paths."""

from __future__ import annotations

import pytest
import torch

from support.families import forward_logits

from sluice.actors.executor.loader import ModelLoadError, load_weights, resolve_model_path
from sluice.actors.executor.model import LlamaModel

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_folder_matches_transformers(tmp_path, kind):
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if kind == "llama":
        config = transformers.LlamaConfig(rope_theta=5000.0, **common)
        model_class = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(rope_theta=5000.0, **common)
        model_class = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    reference = model_class(config).eval()
    if kind == "qwen2":  # make the biases matter
        for layer in reference.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    reference.save_pretrained(tmp_path)

    path = resolve_model_path(tmp_path)
    config, weights = load_weights(path, torch.float32)
    assert config.qkv_bias == (kind == "qwen2")
    assert config.num_kv_heads == 2 and config.rope_theta == 5000.0
    ours = LlamaModel(config, weights)
    ids = list(range(3, 40))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(forward_logits(ours, ids), expected, atol=1e-4, rtol=1e-4)


def test_embedded_gguf_loads_with_its_metadata(smollm_path):
    assert smollm_path.suffix == ".gguf"
    config, weights = load_weights(smollm_path, torch.bfloat16)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert weights["layers.0.q_proj"].dtype == torch.bfloat16


def test_unknown_model_path_names_the_path(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(ModelLoadError, match="nowhere.gguf"):
        resolve_model_path(missing)
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_path(tmp_path)


def test_corrupt_gguf_names_the_file(tmp_path, smollm_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(smollm_path.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_weights(resolve_model_path(broken), torch.float32)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_weights(resolve_model_path(garbage), torch.float32)
