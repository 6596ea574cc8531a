"""A model's shape and the options its forward takes, read from its files by `model_files`
and run by `model.py`. Plain data: importing it costs no torch, so the daemon, which never runs
a model, reads and checks a model's config with it."""

from __future__ import annotations

from dataclasses import dataclass

# "dynamic" (NTK) only changes frequencies past max_position_embeddings, which is never served:
# up to it transformers computes the unscaled base, and so does this table
ROPE_SCALING_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope", "frequency_divisors")


@dataclass(frozen=True)
class RopeScaling:
    """One of `ROPE_SCALING_TYPES` with its parameters, named as transformers names them.

    "frequency_divisors" is how a GGUF file carries Llama 3 scaling: llama.cpp's `rope_freqs`
    tensor, one divisor per frequency. A yarn `attention_factor` of None is derived from
    `factor` (and `mscale`, `mscale_all_dim`) as transformers derives it.

    "longrope" (Phi-3's long-context models; `su` in older configs) divides each frequency by
    its `short_factor` for sequences up to `original_max_position_embeddings`, by its
    `long_factor` past it; `factor` (max over original positions) gives the attention factor
    when `attention_factor` is None."""

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    frequency_divisors: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r} is not supported "
                             f"(supported: {', '.join(ROPE_SCALING_TYPES)})")
        if self.rope_type == "longrope" and self.original_max_position_embeddings < 1:
            raise ValueError("longrope rope scaling needs original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before rotary
    rope_scaling: RopeScaling | None = None
    # keys a query attends back over, itself included (Mistral v0.1, Qwen with
    # use_sliding_window, Gemma's local layers)
    sliding_window: int | None = None
    # per layer, "sliding_attention" or "full_attention" (Gemma 2/3); empty: every layer
    # slides when sliding_window is set
    layer_types: tuple[str, ...] = ()
    # rope base of the sliding layers where it differs from the full ones' (Gemma 3); those
    # layers take no rope scaling
    local_rope_theta: float | None = None
    # ---- Gemma: the norms, activation and scales that differ from Llama's
    hidden_act: str = "silu"  # the MLP's gate: "silu", or "gelu_tanh" (GeGLU)
    embedding_multiplier: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    norm_plus_one: bool = False  # RMSNorm weight applied as (1 + w), in float32
    sandwich_norms: bool = False  # a norm on attention's and on the MLP's output too
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores = cap * tanh(scores / cap); 0: off
    final_softcap: float = 0.0  # the same on the logits
    # ---- mixture of experts (Mixtral, Qwen3-MoE): 0 experts is a dense MLP everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in a MoE model

    def __post_init__(self):
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                given = len(getattr(scaling, name))
                if given != self.head_dim // 2:
                    raise ValueError(f"longrope {name} has {given} values: it needs one per "
                                     f"rotary frequency, {self.head_dim // 2} (head_dim "
                                     f"{self.head_dim})")

    def layer_window(self, layer: int) -> int:
        """Keys a query of `layer` sees back to (itself included); 0: all of them."""
        if self.sliding_window is None:
            return 0
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    @property
    def kv_window(self) -> int:
        """The window every layer slides within (0 when some layer attends to all its keys):
        KV blocks behind it are never read again, and the scheduler gives them back."""
        windows = [self.layer_window(layer) for layer in range(self.num_layers)]
        return 0 if 0 in windows else max(windows)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def max_context(self) -> int:
        """The longest sequence this forward computes as the model was trained to (a sliding
        window is applied by the attention kernel, whatever the length)."""
        return self.max_position_embeddings

    def flops_per_token(self) -> float:
        """Matmul FLOPs of one token's forward, lm_head included (attention scores excluded):
        a MoE layer counts its router and the experts one token runs through."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        total = self.num_layers * attention + self.hidden_size * self.vocab_size
        for layer in range(self.num_layers):
            if self.is_moe_layer(layer):
                total += self.hidden_size * self.num_experts
                total += (3 * self.hidden_size * self.moe_intermediate_size
                          * self.num_experts_per_tok)
            else:
                total += 3 * self.hidden_size * self.intermediate_size
        return 2.0 * total
