"""Executes a `StepPlan`: flattens it into model inputs, runs the forward over the paged KV
pool it owns, and samples. Synchronous and socket-free: the worker process and the
in-process engine both drive it.
"""

from __future__ import annotations

import time
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from sluice.actors.executor.dtypes import parse_dtype, resolve_dtypes
from sluice.actors.executor.loader import load_weights, resolve_model_path
from sluice.actors.executor.model import AttentionInputs, LlamaModel, ModelConfig
from sluice.actors.executor.sampler import sample
from sluice.actors.scheduler.plan import StepPlan, StepResult

DEFAULT_CPU_KV_BYTES = 1 << 30
CUDA_MEMORY_FRACTION = 0.85  # of the free memory after weights, leaving room for activations


class ModelRunner:
    def __init__(self, model_path: str | Path | None = None, *, dtype: str = "auto",
                 kv_dtype: str | None = None, device: str = "cpu",
                 num_blocks: int | None = None, block_size: int = 16,
                 max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 model: LlamaModel | None = None):
        if model is None:
            self.model_path = resolve_model_path(model_path)
            weights_dtype, kv_dtype = resolve_dtypes(dtype, kv_dtype, device)
            config, weights = load_weights(self.model_path, weights_dtype)
            model = LlamaModel(config, weights, device=device, dtype=weights_dtype,
                               kv_dtype=kv_dtype)
        else:
            # a model built elsewhere; the path, when given, still locates its tokenizer
            self.model_path = resolve_model_path(model_path) if model_path else None
        self.model = model
        self.config: ModelConfig = model.config
        self.device = model.device
        self.block_size = block_size
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.num_blocks = num_blocks or self._blocks_for_memory(kv_cache_bytes)
        self.kv_pool = model.new_kv_pool(self.num_blocks, block_size)

    @classmethod
    def from_config(cls, config: ModelConfig, *, dtype: str = "bfloat16", device: str = "cuda",
                    num_blocks: int | None = None, block_size: int = 16,
                    seed: int = 0) -> ModelRunner:
        model = LlamaModel.random(config, device=device, dtype=parse_dtype(dtype), seed=seed)
        return cls(model=model, num_blocks=num_blocks, block_size=block_size)

    def _blocks_for_memory(self, kv_cache_bytes: int | None) -> int:
        cfg = self.config
        bytes_per_block = (2 * cfg.num_layers * self.block_size * cfg.num_kv_heads
                           * cfg.head_dim * self.model.kv_dtype.itemsize)
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = int(free * CUDA_MEMORY_FRACTION)
            else:
                kv_cache_bytes = DEFAULT_CPU_KV_BYTES
        return max(2, kv_cache_bytes // bytes_per_block)

    def reset_kv(self) -> None:
        """A fresh pool: after a fault nothing in the old one can be trusted."""
        self.kv_pool = self.model.new_kv_pool(self.num_blocks, self.block_size)

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        if not plan.seqs:
            return StepResult(step_id=plan.step_id)
        logits = self.forward_logits(plan)
        sampling_seqs = [s for s in plan.seqs if s.sample]
        sampled = {}
        if sampling_seqs:
            for seq, token in zip(sampling_seqs, sample(logits, sampling_seqs)):
                sampled[seq.request_id] = token
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(step_id=plan.step_id, sampled=sampled,
                          forward_seconds=time.perf_counter() - started)

    def forward_logits(self, plan: StepPlan):
        """Run the step's forward (writing its KV); logits of the sequences that sample."""
        inputs, logits_rows = self._prepare(plan)
        hidden = self.model.forward(*inputs)
        # the vocabulary projection only for rows that sample: prefill rows never need it
        return self.model.logits(hidden[logits_rows])

    def _prepare(self, plan: StepPlan):
        """Model inputs for the whole step, built with a handful of array ops, not per token
        or per sequence: the per-sequence lists are flattened once, then everything
        (positions, slot mapping, block tables, the rows that sample) is index arithmetic."""
        bs = self.block_size
        seqs = plan.seqs
        count = len(seqs)
        lengths = np.fromiter(map(len, (s.token_ids for s in seqs)), dtype=np.int64, count=count)
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=count)
        table_lens = np.fromiter(map(len, (s.block_table for s in seqs)), dtype=np.int64,
                                 count=count)
        samples = np.fromiter((s.sample for s in seqs), dtype=bool, count=count)
        ends = starts + lengths
        if int(ends.max()) > self.max_model_len:
            raise ValueError(f"a sequence reaches {int(ends.max())} tokens, past max_model_len "
                             f"{self.max_model_len}")
        query_start = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=query_start[1:])
        num_tokens = int(query_start[-1])
        token_ids = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64,
                                count=num_tokens)
        block_ids = np.fromiter(chain.from_iterable(s.block_table for s in seqs),
                                dtype=np.int64, count=int(table_lens.sum()))
        if block_ids.size and (int(block_ids.max()) >= self.num_blocks
                               or int(block_ids.min()) < 0):
            raise ValueError(f"a block id is outside the pool of {self.num_blocks} blocks")
        # block tables: the flat ids poured row by row into a zero-padded matrix
        tables = np.zeros((count, int(table_lens.max())), dtype=np.int64)
        tables[np.arange(tables.shape[1])[None, :] < table_lens[:, None]] = block_ids
        # position of each token: its sequence's start plus its offset inside the chunk
        seq_of_token = np.repeat(np.arange(count), lengths)
        positions = starts[seq_of_token] + (np.arange(num_tokens) - query_start[seq_of_token])
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        logits_rows = query_start[1:][samples] - 1  # each sampling sequence's last token

        def as_tensor(array, dtype):
            return torch.from_numpy(array).to(device=self.device, dtype=dtype)

        attn = AttentionInputs(
            slot_mapping=as_tensor(slots, torch.int64),
            block_tables=as_tensor(tables, torch.int32),
            query_start_loc=as_tensor(query_start, torch.int32),
            seq_lens=as_tensor(ends, torch.int32),
        )
        inputs = (as_tensor(token_ids, torch.long), as_tensor(positions, torch.long),
                  self.kv_pool, attn)
        return inputs, as_tensor(logits_rows, torch.long)
