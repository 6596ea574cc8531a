"""The llama.cpp peer of `offline.py`: the same workload through llama-cpp-python.

llama.cpp's own server batches the way this runner does: N parallel sequences share one
`llama_decode` call per step, each generating sequence adds its one fed-back token and
sequences still reading their prompt add a chunk of it, all under one batch budget (the
server's continuous batching with chunked prompt ingestion). It runs on the GGUF file as it
is, so it reads the file's own (4-bit) weights where sluice dequantizes them. EOS ignored,
per-request output lengths, the same token ids as every other system; greedy, or sampled as
its server samples: one sampler chain per sequence (temperature, top-p, then a draw seeded
per request), llama.cpp's own.

llama-cpp-python is the optional `bench` extra (`pip install -e '.[bench]'`); `make run` and
`make test` never need it. Its low-level API moved between releases, so the few calls that
were renamed are looked up by either name.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import numpy as np


def _api(llama_cpp, *names: str):
    for name in names:
        found = getattr(llama_cpp, name, None)
        if found is not None:
            return found
    raise AttributeError(f"llama_cpp has none of {', '.join(names)}")


class LlamaCppRunner:
    """One model and context for `parallel` sequences, reused by every `run`."""

    def __init__(self, gguf: Path, *, threads: int, parallel: int, batch_tokens: int = 512,
                 max_context: int = 640):
        import llama_cpp

        self.lib = llama_cpp
        self.parallel = parallel
        self.batch_tokens = batch_tokens
        llama_cpp.llama_backend_init()
        load = _api(llama_cpp, "llama_model_load_from_file", "llama_load_model_from_file")
        self.model = load(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = parallel * max_context
        params.n_batch = batch_tokens
        params.n_ubatch = batch_tokens
        params.n_seq_max = parallel
        params.n_threads = threads
        params.n_threads_batch = threads
        if hasattr(params, "kv_unified"):  # one pool shared by all sequences, as sluice has
            params.kv_unified = True
        new_context = _api(llama_cpp, "llama_init_from_model", "llama_new_context_with_model")
        self.ctx = new_context(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        vocab = getattr(llama_cpp, "llama_model_get_vocab", lambda m: m)(self.model)
        self.n_vocab = _api(llama_cpp, "llama_vocab_n_tokens", "llama_n_vocab")(vocab)
        self.batch = llama_cpp.llama_batch_init(batch_tokens, 0, parallel)
        if hasattr(llama_cpp, "llama_get_memory"):
            memory = llama_cpp.llama_get_memory(self.ctx)
            self._forget = lambda seq: llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
        else:
            remove = _api(llama_cpp, "llama_kv_self_seq_rm", "llama_kv_cache_seq_rm")
            self._forget = lambda seq: remove(self.ctx, seq, -1, -1)
        self.decode_calls = 0
        self.decoded_tokens = 0

    def system_info(self) -> str:
        return self.lib.llama_print_system_info().decode(errors="replace").strip()

    def run(self, prompts: list[list[int]], output_lens: list[int], *,
            temperature: float = 0.0, top_p: float = 1.0,
            seeds: list[int] | None = None) -> tuple[float, list[list[int]]]:
        """Seconds from the first decode to the last token, and each request's output.
        Greedy at temperature 0; else request i draws with seed `seeds[i]`."""
        lib, batch = self.lib, self.batch
        pending = deque(range(len(prompts)))
        free_slots = list(range(self.parallel))
        active: dict[int, dict] = {}  # slot -> {request, fed, out, sampler}
        outputs: list[list[int]] = [[] for _ in prompts]
        started = time.perf_counter()
        while pending or active:
            while pending and free_slots:
                request = pending.popleft()
                sampler = None if temperature == 0.0 else \
                    self._sampler(temperature, top_p, seeds[request] if seeds else request)
                active[free_slots.pop()] = {"request": request, "fed": 0, "sampler": sampler}
            n = 0
            wants_logits: list[tuple[int, int]] = []  # (batch index, slot)
            # generating sequences first: a decode token never waits behind a prompt
            for slot, seq in active.items():
                prompt = prompts[seq["request"]]
                if seq["fed"] >= len(prompt):
                    self._add(n, outputs[seq["request"]][-1], seq["fed"], slot, True)
                    wants_logits.append((n, slot))
                    n += 1
            for slot, seq in active.items():
                prompt = prompts[seq["request"]]
                while seq["fed"] < len(prompt) and n < self.batch_tokens:
                    last = seq["fed"] == len(prompt) - 1
                    self._add(n, prompt[seq["fed"]], seq["fed"], slot, last)
                    if last:
                        wants_logits.append((n, slot))
                    seq["fed"] += 1
                    n += 1
            batch.n_tokens = n
            if lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            self.decode_calls += 1
            self.decoded_tokens += n
            for index, slot in wants_logits:
                seq = active[slot]
                if seq["fed"] < len(prompts[seq["request"]]):
                    continue
                out = outputs[seq["request"]]
                if seq["sampler"] is None:
                    logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, index),
                                                   shape=(self.n_vocab,))
                    out.append(int(logits.argmax()))
                else:  # sample also accepts the token into the chain's state
                    out.append(int(lib.llama_sampler_sample(seq["sampler"], self.ctx, index)))
                if len(out) > 1:
                    seq["fed"] += 1  # the fed-back token just decoded now sits in the cache
                if len(out) >= output_lens[seq["request"]]:
                    if seq["sampler"] is not None:
                        lib.llama_sampler_free(seq["sampler"])
                    self._forget(slot)
                    del active[slot]
                    free_slots.append(slot)
        return time.perf_counter() - started, outputs

    def _sampler(self, temperature: float, top_p: float, seed: int):
        """llama.cpp's chain as its server builds it for these settings: top-p, temperature,
        then a seeded draw from what is left."""
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def _add(self, index: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch = self.batch
        batch.token[index] = token
        batch.pos[index] = pos
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = seq
        batch.logits[index] = logits

    def close(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        _api(lib, "llama_model_free", "llama_free_model")(self.model)


def available() -> str | None:
    """None when llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # an ImportError, or a native library that fails to load
        return f"llama-cpp-python is not installed ({type(exc).__name__}: {exc}); " \
               "pip install -e '.[bench]'"
    return None

