"""GGUF K-quants (Q4_K, Q5_K, Q6_K, the types most downloaded GGUF files hold) are read and
dequantized at load bit-equal to the `gguf` package's dequantization, and a model whose
matrices are K-quants runs as transformers runs the same file.

The `gguf` package cannot quantize to K-quants, so the tensors are blocks of random bytes
with valid (finite, small) float16 scales written where each type keeps them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as reference_dequantize

from sluice.actors.executor.gguf_file import GGUFFile, dequantize
from sluice.actors.executor.loader import load_weights

from support import families
from support.families import GGUF_LAYER_NAMES, GGUF_NAMES, llama_cpp_permute

transformers = pytest.importorskip("transformers")

K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
# where each type keeps its float16 super-block scales (d, and dmin where it has one), and
# the range they are drawn from: small enough for weights of a few hundredths
_SCALES = {GGMLQuantizationType.Q4_K: ((0, 2), 2e-4), GGMLQuantizationType.Q5_K: ((0, 2), 1e-4),
           GGMLQuantizationType.Q6_K: ((208,), 1e-5)}


def k_quant_blocks(rng, rows: int, columns: int, kind) -> np.ndarray:
    """Random `kind` blocks for a [rows, columns] matrix, as rows of bytes, with scales that
    are finite float16 values (random bytes there would also give infinities and NaNs)."""
    block, size = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    offsets, top = _SCALES[kind]
    for offset in offsets:
        scale = rng.uniform(top / 4, top, data.shape[:2]).astype(np.float16)
        data[:, :, offset:offset + 2] = scale[..., None].view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda kind: kind.name)
def test_k_quants_are_dequantized_bit_equal_to_the_gguf_package(tmp_path, kind) -> None:
    rng = np.random.default_rng(int(kind))
    path = tmp_path / f"{kind.name}.gguf"
    writer = GGUFWriter(str(path), "llama")
    matrices = {"matrix": k_quant_blocks(rng, 6, 768, kind),  # 3 super-blocks a row
                "stacked": k_quant_blocks(rng, 8, 256, kind).reshape(2, 4, -1)}  # experts
    for name, raw in matrices.items():
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in GGUFFile(path).tensors}
    assert tensors["matrix"].shape == (768, 6) and tensors["stacked"].shape == (256, 4, 2)
    for name, raw in matrices.items():
        tensor = tensors[name]
        assert tensor.tensor_type == kind and np.array_equal(tensor.data, raw)
        ours, expected = dequantize(tensor), reference_dequantize(raw, kind)
        assert ours.dtype == np.float32 and ours.shape == expected.shape
        assert ours.shape[-1] == {"matrix": 768, "stacked": 256}[name]
        assert np.isfinite(ours).all() and np.array_equal(ours, expected), name
        assert 0 < np.abs(ours).max() < 0.2  # the scales were read where the type keeps them


def write_k_quant_llama(cfg, path) -> dict[str, GGMLQuantizationType]:
    """A Llama of `cfg`'s shape as llama.cpp's converter writes its GGUF, every matrix a
    K-quant of random bytes (the three types in turn), norms of ones in float32; returns
    each matrix's type."""
    with torch.device("meta"):  # the names and shapes alone
        shapes = {name: tuple(t.shape)
                  for name, t in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    rng = np.random.default_rng(0)
    kinds = {}
    for name, shape in shapes.items():
        if name in GGUF_NAMES:
            ours = GGUF_NAMES[name]
        else:
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            module, part = rest.rsplit(".", 1)
            ours = f"blk.{index}.{GGUF_LAYER_NAMES[module]}.{part}"
        if len(shape) == 1:
            writer.add_tensor(ours, np.ones(shape, np.float32))
            continue
        kind = kinds[ours] = K_QUANTS[len(kinds) % len(K_QUANTS)]
        writer.add_tensor(ours, k_quant_blocks(rng, *shape, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kinds


def test_a_k_quant_model_loads_and_generates_as_transformers_reads_it(tmp_path,
                                                                     smollm_tokenizer) -> None:
    """Every matrix a K-quant, rows of 256 and 512 values (one super-block is 256): sluice's
    weights are the `gguf` package's values (q/k rows back in Hugging Face's order), and its
    logits and greedy tokens are those of transformers' own reading of the file."""
    shape = dict(families.SHAPE, hidden_size=256, intermediate_size=512)
    config = transformers.LlamaConfig(rope_theta=5000.0, max_position_embeddings=128, **shape)
    path = tmp_path / "kquants.gguf"
    kinds = write_k_quant_llama(config, path)
    assert set(kinds.values()) == set(K_QUANTS)
    from_file = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, config=config, dtype=torch.float32).eval()
    _, weights = load_weights(path, torch.float32)
    raw = {t.name: t for t in GGUFFile(path).tensors}
    q = reference_dequantize(raw["blk.1.attn_q.weight"].data, kinds["blk.1.attn_q.weight"])
    assert np.array_equal(llama_cpp_permute(weights["layers.1.q_proj"].numpy(),
                                            config.num_attention_heads), q)
    down = reference_dequantize(raw["blk.0.ffn_down.weight"].data,
                                kinds["blk.0.ffn_down.weight"])
    assert torch.equal(weights["layers.0.down_proj"], torch.from_numpy(down))
    vocab = config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(40)], [(11 * i + 5) % vocab for i in range(9)]]
    families.assert_matches_transformers(from_file, path, smollm_tokenizer, prompts,
                                         new_tokens=8, chunk=16)
