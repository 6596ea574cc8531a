"""Reading a model's weights: GGUF files and Hugging Face folders.

This module turns a model path into its `ModelConfig` (read by `model_files`) and a dict of
float tensors named the way `model.py` expects them (already un-permuted, dequantized and in
the requested dtype). It does not build the model or the tokenizer. Finding the model and
reading its config need no torch and live in `model_files`, re-exported here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from sluice.actors.executor.config import ModelConfig
from sluice.actors.executor.model import weight_shapes
from sluice.actors.executor.model_files import (  # noqa: F401 (re-exported)
    EMBEDDED_PACKAGE,
    GEMMA,
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    _gguf_config,
    _hf_config,
    gguf_field,
    open_gguf,
    read_model_config,
    resolve_model_path,
)

# llama.cpp stores these architectures' q/k rows interleaved per head pair (its converter
# permutes them for its rotary layout); Qwen's it keeps in the half-split order as they are
PERMUTED_QK_ARCHITECTURES = ("llama", "mistral")


def load_weights(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if path.is_dir():
        return _load_hf_folder(path, dtype)
    return _load_gguf(path, dtype)


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_attention_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "o_proj",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "ffn_gate_inp.weight": "router",
    # every expert's matrix in one tensor [experts, rows, columns]: split at load
    "ffn_gate_exps.weight": "gate_proj_experts",
    "ffn_up_exps.weight": "up_proj_experts",
    "ffn_down_exps.weight": "down_proj_experts",
}
# Phi-3's fused matrices (ffn_up holds gate then up), split at load as its config.json ones
_GGUF_GEMMA_NAMES = {"post_attention_norm.weight": "attn_out_norm",
                     "ffn_norm.weight": "post_attention_norm",
                     "post_ffw_norm.weight": "mlp_out_norm"}
_GGUF_FAMILY_LAYER_NAMES = {"phi3": {"attn_qkv.weight": "qkv_proj",
                                     "ffn_up.weight": "gate_up_proj"},
                            # Gemma's norms as config.json's (see _HF_FAMILY_LAYER_NAMES)
                            "gemma2": _GGUF_GEMMA_NAMES, "gemma3": _GGUF_GEMMA_NAMES}


def _unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (pairs interleaved per head) back to half-split rotary."""
    half = weight.shape[0] // heads // 2
    grouped = weight.reshape(heads, half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from sluice.actors.executor.gguf_file import dequantize

    reader = open_gguf(path)
    config = _gguf_config(reader, path)
    arch = gguf_field(reader, "general.architecture")
    permuted = arch in PERMUTED_QK_ARCHITECTURES
    layer_names = {**_GGUF_LAYER_NAMES, **_GGUF_FAMILY_LAYER_NAMES.get(arch, {})}
    weights: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for tensor in reader.tensors:
        try:
            values = dequantize(tensor)
        except Exception as exc:
            raise ModelLoadError(f"{path}: tensor {tensor.name} cannot be read ({exc})") from exc
        name = _our_name(tensor.name, _GGUF_TOP_NAMES, "blk.", layer_names)
        if name is None:
            continue
        sources[name] = f"{path}: {tensor.name}"
        if permuted and name.endswith((".q_proj", ".q_bias")):
            values = _unpermute_rotary_rows(values, config.num_heads)
        elif permuted and name.endswith((".k_proj", ".k_bias")):
            values = _unpermute_rotary_rows(values, config.num_kv_heads)
        elif config.norm_plus_one and name.endswith("norm"):
            values = np.asarray(values, dtype=np.float32) - 1  # llama.cpp stores Gemma's 1 + w
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)
    where = f"{path} (architecture {arch})"
    _split_fused(weights, sources, config)
    _split_experts(weights, sources, config)
    _stack_experts(weights, sources, config, where)
    _check_weights(config, weights, sources, where,
                   _file_names(_GGUF_TOP_NAMES, "blk.", layer_names))
    return config, weights


_GGUF_TOP_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                   "output.weight": "lm_head"}


def _split_experts(weights: dict[str, torch.Tensor], sources: dict[str, str],
                   config: ModelConfig) -> None:
    """A GGUF file's [experts, rows, columns] tensors into one matrix per expert."""
    for name in [n for n in weights if n.endswith("_experts")]:
        prefix, matrix = name.rsplit(".", 1)
        stacked = weights.pop(name)
        if stacked.dim() != 3 or stacked.shape[0] != config.num_experts:
            raise ModelLoadError(f"{sources[name]} has shape {tuple(stacked.shape)}, not one "
                                 f"matrix for each of the {config.num_experts} experts")
        for expert, weight in enumerate(stacked.unbind(0)):
            ours = f"{prefix}.experts.{expert}.{matrix.removesuffix('_experts')}"
            weights[ours] = weight
            sources[ours] = sources[name]


def _our_name(name: str, top_level: dict[str, str], layer_prefix: str,
              layer_names: dict[str, str]) -> str | None:
    """A file's tensor name -> ours ("embed", "layers.3.q_proj", ...); None for the unused."""
    if name in top_level:
        return top_level[name]
    if name.startswith(layer_prefix):
        index, rest = name[len(layer_prefix):].split(".", 1)
        short = layer_names.get(rest)
        return f"layers.{index}.{short}" if short else None
    return None


# ---- Hugging Face folder --------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attention_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
# each family's names where they differ from Llama's
_HF_FAMILY_LAYER_NAMES = {
    # q, k and v in one matrix, gate and up in another: split at load
    "phi3": {"self_attn.qkv_proj.weight": "qkv_proj", "mlp.gate_up_proj.weight": "gate_up_proj"},
    # Gemma's post_attention_layernorm norms attention's output; the MLP's input norm is
    # pre_feedforward_layernorm (ours "post_attention_norm", Llama's place for it)
    "gemma": {"post_attention_layernorm.weight": "attn_out_norm",
              "pre_feedforward_layernorm.weight": "post_attention_norm",
              "post_feedforward_layernorm.weight": "mlp_out_norm"},
    "mixtral": {"block_sparse_moe.gate.weight": "router"},
    "qwen3_moe": {"mlp.gate.weight": "router"},
}
# an expert's matrices: Mixtral's w1 (gate), w3 (up), w2 (down); Qwen3-MoE's by name
_HF_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                        r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_MATRICES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _hf_layer_names(model_type: str) -> dict[str, str]:
    family = "gemma" if model_type in GEMMA else model_type
    return {**_HF_LAYER_NAMES, **_HF_FAMILY_LAYER_NAMES.get(family, {})}


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    config = _hf_config(folder)
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    layer_names = _hf_layer_names("gemma3_text" if model_type == "gemma3" else model_type)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    weights: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}  # ours -> "file: its name there", for the refusals
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    name = _hf_name(key, layer_names)
                    if name is not None:
                        weights[name] = handle.get_tensor(key).to(dtype)
                        sources[name] = f"{file}: {key}"
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc
    where = f"{folder} (model_type {model_type})"
    _split_fused(weights, sources, config)
    _stack_experts(weights, sources, config, where)
    _check_weights(config, weights, sources, where,
                   _file_names(_HF_TOP_NAMES, "model.layers.", layer_names, top_prefix="model."))
    return config, weights


def _split_fused(weights: dict[str, torch.Tensor], sources: dict[str, str],
                 config: ModelConfig) -> None:
    """Phi-3's qkv_proj into q, k and v rows, its gate_up_proj into gate and up rows."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    splits = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
              "gate_up_proj": (("gate_proj", "up_proj"),
                               (config.intermediate_size, config.intermediate_size))}
    for name in [n for n in weights if n.rsplit(".", 1)[-1] in splits]:
        prefix, fused = name.rsplit(".", 1)
        parts, rows = splits[fused]
        weight = weights.pop(name)
        if weight.shape != (sum(rows), config.hidden_size):
            raise ModelLoadError(f"{sources[name]} has shape {tuple(weight.shape)}, the config "
                                 f"gives {(sum(rows), config.hidden_size)}")
        for part, piece in zip(parts, weight.split(rows)):
            weights[f"{prefix}.{part}"] = piece
            sources[f"{prefix}.{part}"] = sources[name]


def _stack_experts(weights: dict[str, torch.Tensor], sources: dict[str, str],
                   config: ModelConfig, where: str) -> None:
    """Each MoE layer's experts as two tensors, [experts, 2 * rows, hidden] for gate then up
    and [experts, hidden, rows] for down, built one layer at a time: the model takes them
    as they are, so a MoE model never holds its experts twice while it loads."""
    rows, hidden = config.moe_intermediate_size, config.hidden_size
    shapes = {"gate_proj": (rows, hidden), "up_proj": (rows, hidden), "down_proj": (hidden, rows)}
    for layer in filter(config.is_moe_layer, range(config.num_layers)):
        prefix = f"layers.{layer}."
        pieces: dict[str, list[torch.Tensor]] = {matrix: [] for matrix in shapes}
        for expert in range(config.num_experts):
            for matrix, shape in shapes.items():
                name = f"{prefix}experts.{expert}.{matrix}"
                if name not in weights:
                    raise ModelLoadError(f"{where}: weight {name!r} is missing")
                weight = weights.pop(name)
                if tuple(weight.shape) != shape:
                    raise ModelLoadError(f"{sources[name]} has shape {tuple(weight.shape)}, "
                                         f"the config gives {shape}")
                pieces[matrix].append(weight)
        weights[prefix + "experts_gate_up"] = torch.cat(
            [torch.stack(pieces["gate_proj"]), torch.stack(pieces["up_proj"])], dim=1)
        weights[prefix + "experts_down"] = torch.stack(pieces["down_proj"])


def _file_names(top_level: dict[str, str], layer_prefix: str, layer_names: dict[str, str],
                top_prefix: str = "") -> dict[str, str]:
    """Ours -> the file's name, for a layer's weights by their short name ("q_proj")."""
    names = {ours: theirs if ours == "lm_head" else top_prefix + theirs
             for theirs, ours in top_level.items()}
    names.update({ours: layer_prefix + "{layer}." + theirs for theirs, ours in layer_names.items()})
    return names


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor],
                   sources: dict[str, str], where: str, file_names: dict[str, str]) -> None:
    """Every weight the config needs is there, in the shape it gives; a missing one is named
    as the file would name it."""
    expected = weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        ours = missing[0]
        layer, _, short = ours.removeprefix("layers.").partition(".")
        theirs = (file_names.get(short, "").format(layer=layer) if short
                  else file_names.get(ours))
        named = f"{theirs!r} (ours {ours!r})" if theirs else repr(ours)
        raise ModelLoadError(f"{where}: weight {named} is missing ({len(missing)} of "
                             f"{len(expected)} missing)")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"{sources.get(name, where + ': ' + name)} has shape "
                                 f"{tuple(weights[name].shape)}, the config gives {shape}")


_HF_TOP_NAMES = {"embed_tokens.weight": "embed", "norm.weight": "final_norm",
                 "lm_head.weight": "lm_head"}


# where an image-text checkpoint keeps its language model (transformers has written both)
_HF_PREFIXES = ("language_model.model.", "model.language_model.", "language_model.", "model.")


def _hf_name(key: str, layer_names: dict[str, str] = _HF_LAYER_NAMES) -> str | None:
    prefix = next((p for p in _HF_PREFIXES if key.startswith(p)), "")
    name = key[len(prefix):]
    if name.startswith("layers.") and (expert := _HF_EXPERT.search(name)):
        index = name.split(".", 2)[1]
        matrix = _EXPERT_MATRICES.get(expert.group(2), expert.group(2))
        return f"layers.{index}.experts.{expert.group(1)}.{matrix}"
    return _our_name(name, _HF_TOP_NAMES, "layers.", layer_names)
