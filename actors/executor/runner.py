"""Executes a `StepPlan`: flattens it into model inputs, runs the forward over the paged KV
pool it owns, and samples. Synchronous and socket-free: the worker process and the
in-process engine both drive it.

Unless told its number of blocks, it sizes the pool by profiling: the largest step the
scheduler may plan (`profile_tokens`, as one prefill chunk and as that many decodes) runs
once on a scratch pool, and the pool gets `kv_memory_fraction` of the memory that leaves
(`memory.py`). An out-of-memory error in a step leaves the pool usable: `free_cached_memory`
hands back what the failed step held, and the step can be planned again smaller.

`deterministic=True` puts the model in its deterministic mode (`LlamaModel.use_deterministic`):
greedy output that does not depend on the rest of the batch, on chunking or on the prefix
cache, at some cost in compute.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from sluice.actors.executor import memory
from sluice.actors.executor.dtypes import parse_dtype, resolve_dtypes
from sluice.actors.executor.loader import load_weights, resolve_model_path
from sluice.actors.executor.memory import DEFAULT_KV_MEMORY_FRACTION, KVSizing
from sluice.actors.executor.model import AttentionInputs, LlamaModel, ModelConfig
from sluice.actors.executor.sampler import PenaltyIds, sample
from sluice.actors.scheduler.plan import ScheduledSeq, StepPlan, StepResult
from sluice.ipc.vocabulary import SamplingParams

DEFAULT_CPU_KV_BYTES = memory.DEFAULT_CPU_KV_MAX_BYTES
DEFAULT_PROFILE_TOKENS = 512  # the scheduler's default token budget
# a plan with no sequence waits for a grammar build this long at most before it answers
GRAMMAR_WAIT_SECONDS = 0.025


class ModelRunner:
    def __init__(self, model_path: str | Path | None = None, *, dtype: str = "auto",
                 kv_dtype: str | None = None, device: str = "cpu",
                 num_blocks: int | None = None, block_size: int = 16,
                 max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
                 kv_max_bytes: int | None = None, profile_tokens: int = DEFAULT_PROFILE_TOKENS,
                 model: LlamaModel | None = None, deterministic: bool = False):
        if model is None:
            self.model_path = resolve_model_path(model_path)
            weights_dtype, kv_dtype = resolve_dtypes(dtype, kv_dtype, device)
            config, weights = load_weights(self.model_path, weights_dtype)
            model = LlamaModel(config, weights, device=device, dtype=weights_dtype,
                               kv_dtype=kv_dtype)
            del weights  # the projections the model fused are copies: their parts go now
        else:
            # a model built elsewhere; the path, when given, still locates its tokenizer
            self.model_path = resolve_model_path(model_path) if model_path else None
        if deterministic:
            model.use_deterministic(True)  # before anything runs: warming, profiling
        self.model = model
        self.deterministic = bool(deterministic)
        self.config: ModelConfig = model.config
        self.device = model.device
        self.block_size = block_size
        self.max_model_len = min(max_model_len or self.config.max_context,
                                 self.config.max_context)
        model.limit_positions(self.max_model_len)  # rotary tables no longer than served
        self._out_of_memory_next = False  # a test fault, see `inject_out_of_memory`
        # grammar matchers, made for the first constrained request; set before the profiling
        # step below, which runs like any other
        self._constraints = None
        # the ids of requests with penalties, kept across steps: their plans carry the end
        self._penalty_ids = PenaltyIds()
        self._mask_thread: ThreadPoolExecutor | None = None
        model.warm_row_counts(max(1, profile_tokens))  # before sizing: what it keeps counts
        self.kv_sizing: KVSizing | None = None  # how the pool was sized, when it was profiled
        if num_blocks:
            self.num_blocks = num_blocks
        elif kv_cache_bytes is not None:
            self.num_blocks = max(2, kv_cache_bytes // self.bytes_per_block)
        else:
            if kv_max_bytes is None and self.device.type != "cuda":
                kv_max_bytes = memory.DEFAULT_CPU_KV_MAX_BYTES
            available, peak = self._profile(profile_tokens)
            self.kv_sizing = memory.size_kv_pool(available, peak, self.bytes_per_block,
                                                 fraction=kv_memory_fraction,
                                                 max_bytes=kv_max_bytes)
            self.num_blocks = self.kv_sizing.num_blocks
        self.kv_pool = model.new_kv_pool(self.num_blocks, block_size)

    @property
    def constraints(self):
        """The matchers of constrained requests (`grammar.Constraints`), built on first use:
        a daemon that is never sent a grammar never loads the grammar engine."""
        if self._constraints is None:
            from sluice.actors.executor.grammar import Constraints

            if self.model_path is None:
                raise ValueError("a grammar needs the model's tokenizer: this model has none")
            self._constraints = Constraints.for_model(self.model_path,
                                                      threads=max(1, torch.get_num_threads()))
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._constraints

    @classmethod
    def from_config(cls, config: ModelConfig, *, dtype: str = "bfloat16", device: str = "cuda",
                    num_blocks: int | None = None, block_size: int = 16,
                    seed: int = 0) -> ModelRunner:
        model = LlamaModel.random(config, device=device, dtype=parse_dtype(dtype), seed=seed)
        return cls(model=model, num_blocks=num_blocks, block_size=block_size)

    @property
    def bytes_per_block(self) -> int:
        cfg = self.config
        return (2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim
                * self.model.kv_dtype.itemsize)

    def _profile(self, tokens: int) -> tuple[int, int]:
        """(bytes available to the pool before, bytes the largest step takes at its peak).

        The largest step is `tokens` tokens as one prefill chunk (its attention grows with
        the chunk) and as many one-token decodes (each samples: a vocabulary row each); both
        run on a scratch pool and the larger peak counts. On CUDA the allocator counts the
        peak; on the host it is the growth of the peak RSS, so the forward's workspace is
        charged whatever allocator holds it."""
        tokens = max(1, tokens)
        chunk = min(tokens, self.max_model_len)
        blocks = -(-chunk // self.block_size) + 1
        greedy = SamplingParams(temperature=0.0)
        prefill = [ScheduledSeq(f"profile-{i}", [0] * min(chunk, tokens - start), 0,
                                list(range(blocks - 1)), True, greedy)
                   for i, start in enumerate(range(0, tokens, chunk))]
        decodes = [ScheduledSeq(f"profile-{i}", [0], 0, [i % blocks], True, greedy)
                   for i in range(tokens)]
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            available, _ = torch.cuda.mem_get_info(self.device)
        else:
            available = memory.read_host_available()
        self.num_blocks, self.kv_pool = blocks, self.model.new_kv_pool(blocks, self.block_size)
        peak = 0
        for seqs in (prefill, decodes):
            if cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                before = torch.cuda.memory_allocated(self.device)
                self.execute(StepPlan(0, seqs))
                peak = max(peak, torch.cuda.max_memory_allocated(self.device) - before)
            else:
                # without a reset the peak is the load's, which only overstates the step
                memory.reset_peak_rss()
                before = memory.status_bytes(memory.read_status(), "VmRSS")
                self.execute(StepPlan(0, seqs))
                peak = max(peak, memory.status_bytes(memory.read_status(), "VmHWM") - before)
        del self.kv_pool
        self.free_cached_memory()
        return available, peak

    def free_cached_memory(self) -> None:
        """Give back memory the allocator keeps for reuse (after a step ran out of it)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def inject_out_of_memory(self) -> None:
        """A test fault: the next step's forward raises torch's out-of-memory error, after its
        layers wrote their KV and before anything is sampled."""
        self._out_of_memory_next = True

    def reset_kv(self) -> None:
        """A fresh pool: after a fault nothing in the old one can be trusted."""
        self.kv_pool = self.model.new_kv_pool(self.num_blocks, self.block_size)

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        if plan.grammars:
            self.constraints.build(plan.grammars)
        if not plan.seqs:  # a plan that waits for grammars being built
            return StepResult(step_id=plan.step_id, grammars_built=self._grammars_built(
                GRAMMAR_WAIT_SECONDS))
        sampling_seqs = [s for s in plan.seqs if s.sample]
        self._penalty_ids.fill(sampling_seqs)  # before the masks' thread reads the outputs
        masks = None
        if any(s.sampling.constrained for s in sampling_seqs):
            # the grammar masks are computed on another thread while the forward runs
            constraints = self.constraints
            masks = self._mask_thread.submit(constraints.masks, sampling_seqs)
        elif self._constraints is not None:
            self._constraints.masks(sampling_seqs)  # counts the step: idle matchers go
        try:
            logits = self.forward_logits(plan)
        finally:
            if masks is not None:
                masks = masks.result()
        sampled, logprobs = {}, {}
        if sampling_seqs:
            tokens = sample(logits, sampling_seqs, masks)
            for seq, token in zip(sampling_seqs, tokens):
                sampled[seq.request_id] = token.token_id
                if token.logprob is not None or token.top_logprobs is not None:
                    logprobs[seq.request_id] = token
            if masks is not None:
                self._constraints.advance(sampling_seqs, [t.token_id for t in tokens])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(plan.step_id, sampled, time.perf_counter() - started, logprobs,
                          self._grammars_built())

    def _grammars_built(self, wait: float = 0.0) -> list[int]:
        """The ids of the grammars built since the last result (see `Constraints.take_built`)."""
        if self._constraints is None:
            return []
        return self._constraints.take_built(wait)

    def forward_logits(self, plan: StepPlan):
        """Run the step's forward (writing its KV); logits of the sequences that sample."""
        inputs, logits_rows = self._prepare(plan)
        hidden = self.model.forward(*inputs)
        if self._out_of_memory_next:
            self._out_of_memory_next = False
            raise torch.OutOfMemoryError("test fault: out of memory in a step's forward")
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
