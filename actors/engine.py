"""The in-process engine: scheduler core + model runner + text, with a step-level API.

Used by offline generation, benchmarks and tests, and as the reference the daemon's output
is compared with. Its outputs name how a request ended as the client library does ("stop",
"length", "cancelled", ...): the core's `FinishReason`, spelled once, here at the edge. The daemon splits the same parts across actors and a worker process; this
file stays free of sockets and threads.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from sluice.actors.executor.runner import ModelRunner
from sluice.actors.scheduler import Request, Scheduler, SchedulerConfig
from sluice.ipc.vocabulary import InvalidRequestError
from sluice.actors.scheduler.plan import RequestOutput, StepResult
from sluice.ipc.vocabulary import InvalidParams, SamplingParams
from sluice.actors.scheduler.step_budget import StepBudget
from sluice.actors.text import RequestText, Tokenizer, load_tokenizer
from sluice.ipc.messages import TokenLogprobs
from sluice.ipc.vocabulary import FinishReason


@dataclass
class EngineOutput:
    """What one step produced for one request, with its text delta."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    usage: dict | None = None


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    # one per token id when the request asked for `sampling.logprobs`, as the daemon sends them
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class _Tracked:
    text: RequestText
    completion: Completion


class Engine:
    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 kv_dtype: str | None = None, device: str = "cpu", scheduler_config: SchedulerConfig | None = None,
                 num_blocks: int | None = None, max_model_len: int | None = None,
                 runner: ModelRunner | None = None, tokenizer: Tokenizer | None = None,
                 tensor_parallel: int = 1, deterministic: bool = False):
        config = scheduler_config or SchedulerConfig()
        if tensor_parallel != 1:
            # the model split across `tensor_parallel` rank processes (this one is rank 0)
            from sluice.actors.executor.tensor_parallel import (
                TensorParallelError,
                TensorParallelRunner,
                check_tensor_parallel,
            )

            if runner is not None:
                raise TensorParallelError("tensor_parallel builds its own runner: give a model "
                                          "path, not a runner")
            check_tensor_parallel(None, tensor_parallel)  # a size before any process starts
            if deterministic:
                raise TensorParallelError("the deterministic mode runs on one rank only")
            runner = TensorParallelRunner(model, tensor_parallel, dtype=dtype,
                                          kv_dtype=kv_dtype, device=device,
                                          num_blocks=num_blocks or None,
                                          block_size=config.block_size,
                                          max_model_len=max_model_len)
        if runner is None:
            largest_step = config.token_budget / min(config.prefill_weight, config.decode_weight)
            runner = ModelRunner(model, dtype=dtype, kv_dtype=kv_dtype, device=device,
                                 num_blocks=num_blocks or None, block_size=config.block_size,
                                 max_model_len=max_model_len, profile_tokens=int(largest_step),
                                 deterministic=deterministic)
        elif deterministic and not getattr(runner, "deterministic", False):
            raise ValueError("deterministic=True with a runner made without it: build the "
                             "runner with deterministic=True")
        self.runner = runner
        self.tokenizer = tokenizer or load_tokenizer(runner.model_path)
        config = dataclasses.replace(config, kv_blocks=runner.num_blocks,
                                     block_size=runner.block_size)
        self.scheduler = Scheduler(config, eos_token_ids=self.tokenizer.eos_token_ids,
                                   max_model_len=runner.max_model_len,
                                   kv_window=runner.config.kv_window)
        self.step_budget = StepBudget.for_config(self.scheduler.config)
        self._tracked: dict[str, _Tracked] = {}
        self._awaited: set[str] = set()  # requests a generate() call waits for
        self._finished: dict[str, Completion] = {}  # finished awaited ones, until collected
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop a tensor-parallel engine's other rank processes (nothing to do otherwise)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def add_request(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                    prompt_token_ids: list[int] | None = None,
                    sampling: SamplingParams | None = None, request_id: str | None = None,
                    tenant: str = "default", priority: int = 0) -> str:
        """Queue one request; raises a `RejectedError` (`sluice.ipc.errors`: `InvalidRequestError`,
        `TooLongError`, `QuotaError`, `OverloadedError`) naming what is wrong."""
        sampling = sampling or SamplingParams()
        try:
            ids = self._prompt_ids(prompt, messages, prompt_token_ids)
        except InvalidParams as exc:
            raise InvalidRequestError.about(exc.field, exc.message) from exc
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise InvalidRequestError.about("request_id", f"{request_id!r} is already in use")
        self.scheduler.add_request(Request(request_id, ids, sampling, tenant=tenant,
                                           priority=priority))
        self._tracked[request_id] = _Tracked(RequestText(self.tokenizer, sampling.stop, len(ids)),
                                              Completion(request_id, ids))
        return request_id

    def _prompt_ids(self, prompt, messages, prompt_token_ids) -> list[int]:
        given = [x is not None for x in (prompt, messages, prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidParams("prompt", "give exactly one of prompt, messages, prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidParams("prompt", "must be a non-empty string")
            return self.tokenizer.encode(prompt)
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        ids = list(prompt_token_ids)
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidParams("prompt_token_ids", f"{bad[0]!r} is not a token id in [0, {vocab})")
        return ids

    def abort(self, request_id: str,
              reason: FinishReason = FinishReason.CANCELLED) -> EngineOutput | None:
        out = self.scheduler.abort(request_id, reason)
        return self._track(out) if out is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """One iteration. A step that runs out of memory did not happen: the next ones are
        planned smaller, as in the daemon (`scheduler.step_budget`); at the smallest step
        the error is raised, with the step undone."""
        core = self.scheduler
        expired = core.expire()  # requests past their timeout
        decodes = len(core.running) - len(core.prefilling)
        plan = core.schedule(self.step_budget.next(decodes * core.config.decode_weight))
        # update even an empty plan: the core may have ended requests while planning
        outputs = None
        if plan.seqs or plan.grammars or core.grammars.waiting:
            try:
                result = self.runner.execute(plan)
            except torch.OutOfMemoryError:
                cfg = core.config
                used = (plan.prefill_tokens * cfg.prefill_weight
                        + plan.decode_tokens * cfg.decode_weight)
                outputs = core.step_not_run(plan)  # the requests stay, as before the step
                if not self.step_budget.out_of_memory(used):
                    raise
            else:
                if plan.seqs:
                    self.step_budget.step_ran()
        else:
            result = StepResult(plan.step_id)
        if outputs is None:
            outputs = core.update(plan, result)
        else:  # past the `except`, whose traceback held the failed step's tensors
            self.runner.free_cached_memory()
        return [self._track(out) for out in (*expired, *outputs)]

    def _track(self, out: RequestOutput) -> EngineOutput:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return EngineOutput(out.request_id, out.new_token_ids, "", out.finished,
                                _spelled(out.finish_reason))
        text, completion = tracked.text, tracked.completion
        delta = text.push(out.new_token_ids)
        if text.stopped and not out.finished:
            # a stop string ended the text: end the request in this same iteration
            stopped = self.scheduler.finish(out.request_id)
            if stopped is not None:
                stopped.new_token_ids = out.new_token_ids
                out = stopped
        completion.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            if completion.logprobs is None:
                completion.logprobs = []
            completion.logprobs.extend(text.logprobs(out.logprobs))
        usage = None
        if out.finished:
            delta += text.end(out.finish_reason)
            completion.finish_reason = _spelled(out.finish_reason)
            completion.text = text.text
            usage = dataclasses.asdict(text.usage(out.cached_tokens, out.recomputed_tokens))
            usage["preemptions"] = out.preemptions
            completion.usage = usage
            del self._tracked[out.request_id]
            if out.request_id in self._awaited:
                self._finished[out.request_id] = completion
        return EngineOutput(out.request_id, out.new_token_ids, delta, out.finished,
                            _spelled(out.finish_reason), usage)

    def generate(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                 *, chat: bool = False) -> list[Completion]:
        """Run prompts (strings, token-id lists, or message lists with chat=True) to the end."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params):
                if chat:
                    ids.append(self.add_request(messages=prompt, sampling=sp))
                elif isinstance(prompt, str):
                    ids.append(self.add_request(prompt, sampling=sp))
                else:
                    ids.append(self.add_request(prompt_token_ids=prompt, sampling=sp))
        except Exception:
            for request_id in ids:  # all or nothing: no half-submitted batch keeps running
                self.abort(request_id)
            raise
        self._awaited.update(ids)
        try:
            while any(i in self._tracked for i in ids):
                self.step()
            return [self._finished.pop(i) for i in ids]
        finally:
            self._awaited.difference_update(ids)


def _spelled(reason: FinishReason | None) -> str | None:
    """How the client library names a finish reason ("length"), for the engine's outputs."""
    return None if reason is None else reason.name.lower()
