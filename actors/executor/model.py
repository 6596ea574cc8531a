"""The decoder of every supported family (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias,
Qwen3 with per-head q/k norms, Phi-3, Gemma 2/3, Mixtral and Qwen3-MoE) over one flattened
batch of tokens and a paged KV pool. A family's differences are `ModelConfig` fields (norms,
activation, scales, soft-caps, windows, experts); its weight names are the loader's.

There is one forward for everything: prefill chunks and decode tokens of many sequences are
concatenated; attention reads each sequence's context through its block table. Weight
loading lives in `loader.py`, batching in `runner.py`, rotary tables (with their scaling) in
`rotary.py`; attention in `sluice.kernels`.

Weights run in the model dtype (the KV pool may have its own); the residual add and RMSNorm
are one function and rotary covers q and k in one pass, both computed in float32 with the
reference implementation's expressions, so float32 output matches it exactly. On CPU in bf16
and fp16 they, and SwiGLU, run as fused C++ ops that round where torch does
(`sluice.kernels.elementwise`), and the matmul weights are packed once (`pack_weights`).

In the deterministic mode (`use_deterministic`) a token's hidden states and logits depend only
on its own context, never on what else is in the step, how its prompt was chunked or whether
its prefix came from the cache, so greedy output is the same whichever way a request is
served. What varies otherwise is the reduction order of two things: the matmuls (the BLAS
picks its kernel and blocking by the row count, e.g. a matrix-vector kernel for one row) and
attention (the CPU op sums scores one way or another by its rows per item; long chunks take
gather + SDPA). The mode runs every matmul in tiles of exactly `DETERMINISTIC_ROWS` rows (the
last one padded), where a row's result was measured to depend on nothing but that row, and
attention in its fixed-order mode (see `sluice.kernels`). Norms, rotary, activations and
the residual adds are per row already. It costs compute: a step of one row runs its matmuls
at `DETERMINISTIC_ROWS` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice import kernels
from sluice.kernels import elementwise
from sluice.actors.executor.config import ModelConfig  # noqa: F401 (its home before config.py)
from sluice.actors.executor.moe import MoEMLP
from sluice.actors.executor.rotary import rotary_tables

# rows of every matmul tile in the deterministic mode: one kernel shape for every matmul a
# layer runs, whatever the step's size; small enough that a lone decode pads to little
DETERMINISTIC_ROWS = 16
# the row count oneDNN lays packed weights out for; measured on AVX512-BF16/AMX: from 16 up,
# every row count gives F.linear's bits, and 64 ran decode's counts fastest
PACKING_ROWS_HINT = 64


@dataclass
class AttentionInputs:
    """Where each token's K/V goes and what each sequence attends to (see sluice.kernels)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]


class _Layer:
    __slots__ = ("input_norm", "qkv", "qkv_bias", "qk_norm", "o_proj", "attn_out_norm",
                 "post_norm", "gate_up", "down", "moe", "mlp_out_norm", "rotary", "window")


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 kv_dtype: torch.dtype | None = None):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the pool may differ: the kernels cast on write
        missing = [n for n in _required_names(config) if n not in weights]
        if missing:
            raise ValueError(f"model weights are missing {missing[0]!r} ({len(missing)} missing)")

        def take(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def take_norm(name: str) -> torch.Tensor:
            if config.norm_plus_one:  # kept in float32: Gemma multiplies before casting back
                return (1.0 + weights[name].to(device=self.device, dtype=torch.float32))
            return take(name)

        self.activation = _ACTIVATIONS[config.hidden_act]
        self.embed = take("embed")
        self.final_norm = take_norm("final_norm")
        self.lm_head = self.embed if config.tie_word_embeddings else take("lm_head")
        # rotary tables over the positions served: every position the model knows until
        # `limit_positions` says fewer (a runner, by its max model length); built on first use
        self.rotary_positions = config.max_context
        self._rotary_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            prefix = f"layers.{i}."
            layer = _Layer()
            layer.input_norm = take_norm(prefix + "input_norm")
            layer.post_norm = take_norm(prefix + "post_attention_norm")
            # one matmul for q, k and v, one for gate and up: fewer, larger GEMMs per layer
            layer.qkv = torch.cat([take(prefix + n) for n in ("q_proj", "k_proj", "v_proj")])
            layer.qkv_bias = (
                torch.cat([take(prefix + n) for n in ("q_bias", "k_bias", "v_bias")])
                if config.qkv_bias else None
            )
            # one weight row per q head then per k head: one norm over both heads' sets
            layer.qk_norm = (
                torch.cat([take_norm(prefix + "q_norm").expand(config.num_heads, -1),
                           take_norm(prefix + "k_norm").expand(config.num_kv_heads, -1)])
                if config.qk_norm else None
            )
            layer.o_proj = take(prefix + "o_proj")
            layer.attn_out_norm = layer.mlp_out_norm = None
            if config.sandwich_norms:
                layer.attn_out_norm = take_norm(prefix + "attn_out_norm")
                layer.mlp_out_norm = take_norm(prefix + "mlp_out_norm")
            layer.gate_up = layer.down = layer.moe = None
            if config.is_moe_layer(i):
                layer.moe = MoEMLP(take(prefix + "router"), take(prefix + "experts_gate_up"),
                                   take(prefix + "experts_down"), config.num_experts_per_tok,
                                   config.norm_topk_prob, self.activation)
            else:
                layer.gate_up = torch.cat([take(prefix + "gate_proj"), take(prefix + "up_proj")])
                layer.down = take(prefix + "down_proj")
            layer.window = config.layer_window(i)  # 0: full attention
            layer.rotary = 1 if layer.window and config.local_rope_theta is not None else 0
            self.layers.append(layer)
        self.scale = (config.attention_scale if config.attention_scale is not None
                      else config.head_dim ** -0.5)
        # oneDNN, which runs torch's reduced-precision matmuls on the host, compiles and keeps
        # kernels for every row count it meets (about 1.5 MB each here): unpadded, a worker's
        # memory grows for as long as new step sizes turn up. Rows padded to a few sizes per
        # octave (at most 1/16 more work) bound what it keeps; `warm_row_counts` fills it.
        self.pads_rows = self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        self.deterministic = False  # see `use_deterministic`
        self._linear = F.linear
        # where the ranks of a tensor-parallel group meet (see tensor_parallel.py): the sum of
        # their o_proj and down outputs, and the logits of every rank's vocabulary rows
        self.all_reduce = _identity
        self.gather_logits = _identity
        self.packed = False  # see `pack_weights`
        self.pack_weights(packs_weights(self.device, dtype))
        # the residual add with RMSNorm, rotary and SwiGLU: one fused pass over each row where
        # the CPU ops run them (bf16 and fp16, see `sluice.kernels.elementwise`), else torch's
        fused = elementwise.available_for(self.device, dtype)
        self._add_rms_norm = _fused_add_rms_norm if fused else _add_rms_norm
        self._rotate = _fused_rotate if fused else _rotate
        self._swiglu = (elementwise.silu_mul if fused and config.hidden_act == "silu"
                        else self._gated)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """activation(gate) * up, for gate_up holding (gate, up) side by side."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.activation(gate) * up

    def use_deterministic(self, on: bool = True) -> None:
        """Turn the deterministic mode on or off (see the module's docstring): every matmul in
        fixed row tiles, attention in its fixed-order mode. CPU only: the Triton kernel has no
        fixed-order mode yet."""
        if on and self.device.type != "cpu":
            raise ValueError(f"the deterministic mode runs on the CPU only, not on "
                             f"{self.device.type}")
        self.deterministic = bool(on)
        self.pack_weights(packs_weights(self.device, self.dtype))
        self._linear = self._matmul()
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.linear = _tiled_linear if on else F.linear

    def pack_weights(self, on: bool = True) -> None:
        """Hold the layer matmuls' weights and lm_head in oneDNN's blocked layout (`on`), or as
        plain row-major tensors. Packed once here, a weight is not reordered by every matmul
        that reads it: in bfloat16 on a CPU with native bf16 (`packs_weights`) that was
        measured 1.4-2x faster per matmul at decode's row counts, with the same bits as
        `F.linear`. A tied lm_head gets a packed copy of its own (the embedding lookup reads the
        plain one). MoE experts stay plain. The deterministic mode runs packed weights in its
        fixed tiles too (`_tiled_packed_linear`)."""
        if on == self.packed:
            return
        if on:
            def convert(w: torch.Tensor) -> torch.Tensor:
                return torch.ops.mkldnn._reorder_linear_weight(w, PACKING_ROWS_HINT)
        else:
            def convert(w: torch.Tensor) -> torch.Tensor:
                return w.to_dense()
        for layer in self.layers:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                weight = getattr(layer, name)
                if weight is not None:
                    setattr(layer, name, convert(weight))
        self.lm_head = (self.embed if not on and self.config.tie_word_embeddings
                        else convert(self.lm_head))
        self.packed = on
        self._linear = self._matmul()

    def _matmul(self):
        """The layer matmul for the mode and the weights' layout: in the deterministic mode fixed
        tiles (of packed weights one oneDNN call each, else one batched matmul), else one call."""
        if self.deterministic:
            return _tiled_packed_linear if self.packed else _tiled_linear
        return _packed_linear if self.packed else F.linear

    def limit_positions(self, positions: int) -> None:
        """Serve sequences of at most `positions` tokens: the rotary tables cover only those,
        built now (before a runner measures the memory a step takes). Phi-3's longrope also
        takes its short or long factors by this length."""
        if not 0 < positions <= self.config.max_context:
            raise ValueError(f"positions served must be from 1 to the model's context "
                             f"({self.config.max_context}), got {positions}")
        if positions != self.rotary_positions:
            self.rotary_positions, self._rotary_tables = positions, None
        _ = self.rotary_tables  # built here, not in the first forward

    @property
    def rotary_tables(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of the full-attention layers, then of the sliding ones where they differ,
        each [rotary_positions, head_dim] float32."""
        if self._rotary_tables is None:
            cfg = self.config
            tables = [rotary_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                                    cfg.rope_scaling, self.device, rows=self.rotary_positions)]
            if cfg.local_rope_theta is not None:
                tables.append(rotary_tables(cfg.head_dim, cfg.local_rope_theta,
                                            cfg.max_position_embeddings, None, self.device,
                                            rows=self.rotary_positions))
            self._rotary_tables = tables
        return self._rotary_tables

    @classmethod
    def random(cls, config: ModelConfig, device="cpu", dtype=torch.float32,
               seed: int = 0) -> LlamaModel:
        """Random weights of the given shape: for benchmarks of big shapes without a file."""
        # drawn on the target device in the target dtype: an 8B shape never touches host memory
        generator = torch.Generator(device=device).manual_seed(seed)
        weights = {}
        for name, shape in weight_shapes(config).items():
            if name.endswith("norm"):
                weights[name] = torch.full(shape, 0.0 if config.norm_plus_one else 1.0,
                                           device=device, dtype=dtype)
            else:
                weights[name] = torch.empty(shape, device=device, dtype=dtype).normal_(
                    0.0, 0.02, generator=generator)
        return cls(config, weights, device=device, dtype=dtype)

    def new_kv_pool(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # zeros, not empty: attention masks padded positions, and 0 * NaN would still be NaN
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        return [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(self.config.num_layers)
        ]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_pool: list[tuple[torch.Tensor, torch.Tensor]],
                attn: AttentionInputs) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        cfg = self.config
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        linear = self._linear
        add_rms_norm, rotate = self._add_rms_norm, self._rotate
        rows = input_ids.shape[0]
        pad = self.padded_rows(rows) - rows
        if pad:  # padding rows: token 0 at position 0, never attended to or written to KV
            input_ids, positions = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad))
        hidden = self.embed[input_ids]
        if cfg.embedding_multiplier != 1.0:  # rounded to the model dtype, as Gemma does
            hidden = hidden * torch.tensor(cfg.embedding_multiplier, dtype=hidden.dtype)
        # this batch's rows of each rotary table, as (cos, sin) shaped to broadcast over heads
        rotary = [tuple(t[positions].unsqueeze(1) for t in tables)
                  for tables in self.rotary_tables]
        residual = None
        for layer, (key_cache, value_cache) in zip(self.layers, kv_pool):
            normed, residual = add_rms_norm(hidden, residual, layer.input_norm, cfg.rms_norm_eps)
            qkv = linear(normed, layer.qkv, layer.qkv_bias)
            # q and k sit side by side in qkv's rows: one norm and one rotary pass over both
            qk = qkv[:, :q_size + kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            if layer.qk_norm is not None:
                qk, _ = add_rms_norm(qk, None, layer.qk_norm, cfg.rms_norm_eps)
            qk = rotate(qk, *rotary[layer.rotary])
            q, k = qk[:rows].split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:rows, q_size + kv_size:].reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            kernels.reshape_and_cache(k, v, key_cache, value_cache, attn.slot_mapping)
            attended = kernels.paged_attention(
                q.contiguous(), key_cache, value_cache, attn.block_tables,
                attn.query_start_loc, attn.seq_lens, self.scale, window=layer.window,
                softcap=cfg.attn_softcap, fixed_order=self.deterministic,
            )
            attended = attended.view(-1, q_size)
            hidden = self.all_reduce(linear(F.pad(attended, (0, 0, 0, pad)) if pad
                                            else attended, layer.o_proj))
            if layer.attn_out_norm is not None:
                hidden, _ = add_rms_norm(hidden, None, layer.attn_out_norm, cfg.rms_norm_eps)
            normed, residual = add_rms_norm(hidden, residual, layer.post_norm, cfg.rms_norm_eps)
            if layer.moe is not None:
                hidden = layer.moe(normed)
            else:
                hidden = linear(self._swiglu(linear(normed, layer.gate_up)), layer.down)
            hidden = self.all_reduce(hidden)
            if layer.mlp_out_norm is not None:
                hidden, _ = add_rms_norm(hidden, None, layer.mlp_out_norm, cfg.rms_norm_eps)
        normed, _ = add_rms_norm(hidden, residual, self.final_norm, cfg.rms_norm_eps)
        return normed[:rows]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        pad = self.padded_rows(rows) - rows
        if pad:
            hidden = F.pad(hidden, (0, 0, 0, pad))
        logits = self.gather_logits(self._linear(hidden, self.lm_head))[:rows]
        if self.config.final_softcap:  # Gemma 2's, in the model dtype as transformers does
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits.float()

    def padded_rows(self, rows: int) -> int:
        """The row count a matmul of `rows` rows runs at: `rows` itself up to 32, then rounded
        up to a 16th of its power of two (at most 1/16 more); in the deterministic mode, whole
        tiles of `DETERMINISTIC_ROWS`."""
        if self.deterministic:
            return -(-rows // DETERMINISTIC_ROWS) * DETERMINISTIC_ROWS
        if not self.pads_rows or rows <= 32:
            return rows
        step = 1 << (rows.bit_length() - 5)
        return -(-rows // step) * step

    @torch.inference_mode()
    def warm_row_counts(self, max_rows: int) -> None:
        """Run each layer matmul once at every padded row count up to `max_rows` (the largest
        step), so that the kernels oneDNN keeps for them (~1 MB each) are made before the pool
        is sized and the worker serves: its memory is then flat from the start. The vocabulary
        matmul is left to fill as batches grow (~0.5 MB per row count): warming it would cost
        seconds per start, most of it for batches the worker may never see."""
        if not (self.pads_rows or self.deterministic):
            return
        layer = self.layers[0]
        matmuls = [(w, b) for w, b in ((layer.qkv, layer.qkv_bias), (layer.o_proj, None),
                                       (layer.gate_up, None), (layer.down, None))
                   if w is not None]  # a MoE layer's experts see row counts of their own
        inputs = {w.shape[1]: torch.zeros(self.padded_rows(max_rows), w.shape[1],
                                          dtype=self.dtype, device=self.device)
                  for w, _ in matmuls}
        if self.deterministic:  # one row count: the tile's
            max_rows = DETERMINISTIC_ROWS
        for rows in sorted({self.padded_rows(n) for n in range(1, max_rows + 1)}):
            for weight, bias in matmuls:
                self._linear(inputs[weight.shape[1]][:rows], weight, bias)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def packs_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` holds its matmul weights packed: bfloat16 on a
    CPU where oneDNN runs bf16 natively (elsewhere packing was not measured to pay; in float16
    it did not on AVX512-FP16)."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packed_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a weight `pack_weights` packed."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _tiled_packed_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`_tiled_linear` over a packed weight: one oneDNN matmul per tile of exactly
    `DETERMINISTIC_ROWS` rows (the last one zero-padded). oneDNN's kernel for that row count
    was measured to give each row the same bits at every place in a tile (the tests check it
    on the machine they run on); torch's batched matmul in bf16 ran 10-25x slower than this."""
    rows, tile = x.shape[0], DETERMINISTIC_ROWS
    tiles = -(-rows // tile)
    if tiles * tile != rows:
        x = F.pad(x, (0, 0, 0, tiles * tile - rows))
    out = torch.empty(tiles * tile, weight.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, tiles * tile, tile):
        out[start:start + tile] = _packed_linear(x[start:start + tile], weight, bias)
    return out[:rows]


def _tiled_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear computed as matmuls of exactly `DETERMINISTIC_ROWS` rows each (the last tile
    zero-padded), so each row's reduction order is the one kernel's, whatever the row count.

    The tiles go to one batched matmul over the same weight: each tile's product was
    measured to be bitwise the product of that tile alone, at every batch count and position
    (tests/unit/engine/test_deterministic_mode.py checks it on the machine it runs on), and
    one call costs about what one matmul of all the rows does, where a loop of matmuls pays
    each call's thread start-up again."""
    rows, tile = x.shape[0], DETERMINISTIC_ROWS
    tiles = -(-rows // tile)
    if tiles * tile != rows:
        x = F.pad(x, (0, 0, 0, tiles * tile - rows))
    x = x.reshape(tiles, tile, x.shape[1])
    transposed = weight.t().expand(tiles, *weight.t().shape)
    out = (torch.bmm(x, transposed) if bias is None
           else torch.baddbmm(bias, x, transposed))
    return out.view(tiles * tile, weight.shape[0])[:rows]


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual): the residual add and the norm at once.

    The sum stays in the model dtype (it is the residual stream the next layer adds to, as in
    the reference implementation); the norm runs in float32 and is cast back before the weight
    multiplies it, again as the reference does, so fp32 outputs match it exactly.
    """
    summed = x if residual is None else x + residual
    normed = F.rms_norm(summed.float(), (summed.shape[-1],), None, eps)
    if weight.dtype == torch.float32:  # a float32 model, or Gemma's (1 + w) in any dtype
        return (normed * weight).to(summed.dtype), summed
    return normed.to(summed.dtype) * weight, summed


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split layout) computed in float32, cast back once at the end."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    # the reference's exact expression (no fused multiply-add): float32 stays bit-identical
    return (x32 * cos + rotated * sin).to(x.dtype)


def _fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_add_rms_norm` in one pass per row where the fused op takes it (rows of hidden states
    with a weight in their dtype; not Qwen3's per-head norms or Gemma's float32 weights)."""
    if x.dim() == 2 and weight.dim() == 1 and weight.dtype == x.dtype:
        return elementwise.add_rms_norm(x, residual, weight, eps)
    return _add_rms_norm(x, residual, weight, eps)


def _fused_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`_rotate` in one pass per row where the fused op takes it (whole heads side by side)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0:
        return elementwise.rotate(x, cos, sin)
    return _rotate(x, cos, sin)


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (config.vocab_size, h), "final_norm": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_norm": (h,), p + "post_attention_norm": (h,),
            p + "q_proj": (q, h), p + "k_proj": (kv, h), p + "v_proj": (kv, h),
            p + "o_proj": (h, q),
        })
        if config.is_moe_layer(i):
            experts, inter = config.num_experts, config.moe_intermediate_size
            shapes.update({p + "router": (experts, h),
                           p + "experts_gate_up": (experts, 2 * inter, h),  # gate rows, up rows
                           p + "experts_down": (experts, h, inter)})
        else:
            inter = config.intermediate_size
            shapes.update({p + "gate_proj": (inter, h), p + "up_proj": (inter, h),
                           p + "down_proj": (h, inter)})
        if config.sandwich_norms:
            shapes.update({p + "attn_out_norm": (h,), p + "mlp_out_norm": (h,)})
        if config.qkv_bias:
            shapes.update({p + "q_bias": (q,), p + "k_bias": (kv,), p + "v_bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "q_norm": (config.head_dim,), p + "k_norm": (config.head_dim,)})
    return shapes


def _required_names(config: ModelConfig) -> list[str]:
    return list(weight_shapes(config))
