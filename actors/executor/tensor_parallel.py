"""Tensor parallelism over `torch.distributed`: one model sharded across N rank processes.

Megatron-style sharding of a loaded model's weights for rank r of N:

- attention: the q, k and v rows are split by heads (each rank holds `num_heads / N` query
  heads and the KV heads they read: `num_kv_heads / N` of them, or, when there are fewer KV
  heads than ranks, the one KV head its query heads share, replicated); o_proj is split by
  its input columns the same way and its output all-reduced. Qwen2's q/k/v biases go with
  their rows; Qwen3's per-head q/k norms are the same for every head and stay whole.
- MLP: gate and up rows split by the intermediate size, down split by its input columns and
  its output all-reduced. A mixture-of-experts layer splits every expert the same way (the
  router stays whole: every rank routes every token alike).
- embeddings replicated (a lookup, no matmul to share); lm_head split by vocabulary (its rows
  padded to a multiple of N), each rank's logits gathered so that every rank holds the whole
  vocabulary's and samples alike.

Each rank builds an ordinary `LlamaModel` from its shard with a config holding its share of
heads and intermediate size, so its KV pool holds only its KV heads; every rank runs the
same batch with the same block ids. The model's `all_reduce` and `gather_logits` hooks are
where the ranks meet.

Ranks are separate processes (multiprocessing "spawn"), each loading the model files itself
and keeping only its shard; they form one process group (gloo on CPU, NCCL on CUDA) over a TCP
store on a port the parent picks. `greedy` runs prompts to completion on a group and is what
the tests hold to a single process's output.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import zmq

from sluice.actors.executor.config import ModelConfig
from sluice.actors.executor.model import AttentionInputs, LlamaModel
from sluice.actors.executor.rank_join import (
    PLAN, READY, RESET, STOP, GroupGone, JoinDesk, model_fingerprint,
)  # fmt: skip
from sluice.actors.runtime.registry import CODEC
from sluice.actors.executor.shards import (
    TensorParallelError,
    check_tensor_parallel,
    rank_config,
    rank_shares,
    vocab_shard_rows,
)


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor], rank: int,
                  tensor_parallel: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Rank `rank` of `tensor_parallel`'s config and weights (named as `load_weights` names
    them), cut from a whole model's. Tensors are copies: the whole ones can be dropped."""
    n = tensor_parallel
    if not 0 <= rank < max(n, 1):
        raise TensorParallelError(f"rank {rank} is outside a tensor_parallel group of {n}")
    shard_config = rank_config(config, rank, n)
    if n == 1:
        return config, dict(weights)
    d = config.head_dim
    share = rank_shares(config, n)[rank]
    q_rows = slice(share.q_heads.start * d, share.q_heads.stop * d)
    kv_rows = slice(share.kv_heads.start * d, share.kv_heads.stop * d)
    inter = slice(share.intermediate.start, share.intermediate.stop)
    expert_inter = slice(share.expert_intermediate.start, share.expert_intermediate.stop)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        leaf = name.rsplit(".", 1)[-1]
        if name in ("embed", "lm_head"):
            if name == "embed":
                out[name] = tensor
            continue
        if leaf in ("q_proj", "q_bias"):
            piece = tensor[q_rows]
        elif leaf in ("k_proj", "v_proj", "k_bias", "v_bias"):
            piece = tensor[kv_rows]
        elif leaf == "o_proj":
            piece = tensor[:, q_rows]
        elif leaf == "experts_gate_up":  # [experts, gate rows then up rows, hidden]
            size = config.moe_intermediate_size
            piece = torch.cat([tensor[:, expert_inter],
                               tensor[:, size + expert_inter.start:size + expert_inter.stop]],
                              dim=1)
        elif leaf == "experts_down":  # [experts, hidden, intermediate]
            piece = tensor[:, :, expert_inter]
        elif ".experts." in name and leaf in ("gate_proj", "up_proj"):
            piece = tensor[expert_inter]
        elif ".experts." in name and leaf == "down_proj":
            piece = tensor[:, expert_inter]
        elif leaf in ("gate_proj", "up_proj"):
            piece = tensor[inter]
        elif leaf == "down_proj":
            piece = tensor[:, inter]
        else:  # norms, q/k norms, the router: whole on every rank
            out[name] = tensor
            continue
        out[name] = piece.clone()
    head = weights["embed"] if config.tie_word_embeddings else weights["lm_head"]
    rows = vocab_shard_rows(config.vocab_size, n)
    lm_head = head[rank * rows:(rank + 1) * rows]
    if lm_head.shape[0] < rows:  # the last rank's padding rows: logits dropped when gathered
        lm_head = torch.cat([lm_head, lm_head.new_zeros(rows - lm_head.shape[0],
                                                        lm_head.shape[1])])
    out["lm_head"] = lm_head.clone()
    return shard_config, out


def attach_group(model: LlamaModel, vocab_size: int, group=None) -> LlamaModel:
    """Make a rank's sharded model meet the others: sum partial o_proj/down outputs, gather
    the logits of every rank's vocabulary rows."""
    import torch.distributed as dist

    world = dist.get_world_size(group)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    def gather_logits(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits, group=group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    if world > 1:
        model.all_reduce = all_reduce
        model.gather_logits = gather_logits
    return model


def free_port() -> int:
    """A TCP port free on this host now, for the group's rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, port: int, device: str = "cpu",
               timeout_s: float = 120.0, host: str = "127.0.0.1",
               step_timeout_s: float | None = None):
    """Join the group's process group: gloo on CPU, NCCL on CUDA. `timeout_s` bounds the
    rendezvous; with `step_timeout_s`, returns a group over the same ranks whose collectives
    wait that long at most, for the steps (None: the steps use the default group)."""
    import torch.distributed as dist

    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if step_timeout_s is None:
        return None
    return dist.new_group(backend=backend,
                          timeout=datetime.timedelta(seconds=step_timeout_s))


def load_rank_model(model_path: str | Path, rank: int, tensor_parallel: int,
                    dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaModel:
    """Rank `rank`'s model: the files loaded, cut to its shard, the whole weights dropped."""
    from sluice.actors.executor.loader import load_weights, resolve_model_path

    config, weights = load_weights(resolve_model_path(str(model_path)), dtype)
    check_tensor_parallel(config, tensor_parallel)
    shard_config, shard = shard_weights(config, weights, rank, tensor_parallel)
    del weights
    model = LlamaModel(shard_config, shard, device=device, dtype=dtype)
    model.full_config = config
    return model


# -- greedy generation over a block-paged pool (the same plan on every rank) ----------------

def greedy_tokens(model: LlamaModel, prompts: Sequence[Sequence[int]], max_tokens: int,
                  block_size: int = 16) -> list[list[int]]:
    """Greedy continuations of `prompts`, batched: one prefill of them all, then one decode
    step per token, each sequence in its own blocks of one pool. Run alike on every rank."""
    tables, first = [], 0
    for prompt in prompts:
        blocks = -(-(len(prompt) + max_tokens) // block_size)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                device=model.device)
    pool = model.new_kv_pool(first, block_size)
    contexts = [list(p) for p in prompts]
    new_ids = [list(p) for p in prompts]  # this step's tokens per sequence
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        ids, positions, slots, starts = [], [], [], [0]
        for table, context, step in zip(tables, contexts, new_ids):
            for pos in range(len(context) - len(step), len(context)):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            ids.extend(step)
            starts.append(starts[-1] + len(step))
        attn = AttentionInputs(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=model.device),
            block_tables=block_tables,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=model.device),
            seq_lens=torch.tensor([len(c) for c in contexts], dtype=torch.int32,
                                  device=model.device))
        hidden = model.forward(torch.tensor(ids, device=model.device),
                               torch.tensor(positions, device=model.device), pool, attn)
        last = torch.tensor(starts[1:], device=model.device) - 1
        chosen = model.logits(hidden[last]).argmax(dim=-1).tolist()
        for i, token in enumerate(chosen):
            outputs[i].append(token)
            contexts[i].append(token)
            new_ids[i] = [token]
    return outputs


def _rank_main(rank: int, world_size: int, port: int, jobs: list[tuple[str, list[list[int]], int]],
               dtype: str, threads: int, results: multiprocessing.Queue) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        init_group(rank, world_size, port)
        answers = []
        for model_path, prompts, max_tokens in jobs:
            model = load_rank_model(model_path, rank, world_size, dtype=getattr(torch, dtype))
            attach_group(model, model.full_config.vocab_size)
            answers.append(greedy_tokens(model, prompts, max_tokens))
            del model
        results.put((rank, "ok", answers))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # the parent reports it and ends the group
        results.put((rank, "error", traceback.format_exc()))


def greedy(model_path: str | Path, prompts: Sequence[Sequence[int]], max_tokens: int,
           tensor_parallel: int, *, dtype: str = "float32", threads: int = 1,
           timeout_s: float = 300.0) -> list[list[int]]:
    """Greedy continuations of `prompts` from a group of `tensor_parallel` rank processes on
    this host (CPU, gloo). Every rank must produce the same tokens; rank 0's are returned."""
    return greedy_many([(model_path, prompts, max_tokens)], tensor_parallel, dtype=dtype,
                       threads=threads, timeout_s=timeout_s)[0]


def greedy_many(jobs: Sequence[tuple[str | Path, Sequence[Sequence[int]], int]],
                tensor_parallel: int, *, dtype: str = "float32", threads: int = 1,
                timeout_s: float = 300.0) -> list[list[list[int]]]:
    """`greedy` for several (model path, prompts, max tokens) jobs, one model after another
    on one group of rank processes (started once)."""
    from sluice.actors.executor.loader import read_model_config, resolve_model_path

    plan = []
    for model_path, prompts, max_tokens in jobs:
        path = resolve_model_path(str(model_path))
        config = read_model_config(path)
        check_tensor_parallel(config, tensor_parallel)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise TensorParallelError(f"max_tokens must be a whole number ≥ 1, not "
                                      f"{max_tokens!r}")
        for prompt in prompts:
            if not len(prompt):
                raise TensorParallelError("a prompt is empty: give at least one token id")
            bad = [t for t in prompt if not 0 <= int(t) < config.vocab_size]
            if bad:
                raise TensorParallelError(
                    f"token id {bad[0]} is outside the model's vocabulary "
                    f"(0..{config.vocab_size - 1})")
        plan.append((str(path), [list(map(int, p)) for p in prompts], int(max_tokens)))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank_main, daemon=True, name=f"sluice-tp-rank-{r}",
                             args=(r, tensor_parallel, port, plan, dtype, threads, results))
             for r in range(tensor_parallel)]
    for process in ranks:
        process.start()
    answers: dict[int, list[list[list[int]]]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(answers) < tensor_parallel:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue_module.Empty:
                # a rank that died without a word (killed, or failed before it could answer)
                # fails the group now, not at the deadline
                dead = [(r, p.exitcode) for r, p in enumerate(ranks)
                        if p.exitcode is not None and r not in answers]
                if dead and results.empty():
                    rank, code = dead[0]
                    raise TensorParallelError(
                        f"tensor_parallel rank {rank} exited (code {code}) before it "
                        f"answered") from None
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor_parallel group of {tensor_parallel} gave no answer in "
                        f"{timeout_s:g} s") from None
                continue
            if status != "ok":
                raise TensorParallelError(f"tensor_parallel rank {rank} failed:\n{payload}")
            answers[rank] = payload
        for process in ranks:
            process.join(timeout=30)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    if any(answers[r] != answers[0] for r in answers):
        raise TensorParallelError("tensor_parallel ranks disagree on the greedy tokens")
    return answers[0]


# -- a group serving an engine: rank 0 in the engine's process, the others in children -------

def _rank_runner(model_path: str, rank: int, tensor_parallel: int, dtype: str,
                 kv_dtype: str | None, device: str, num_blocks: int, block_size: int,
                 max_model_len: int | None, group=None):
    """Rank `rank`'s ModelRunner over its shard, its pool `num_blocks` blocks (every rank's
    the same: the plan's block ids are the group's)."""
    from sluice.actors.executor.dtypes import resolve_dtypes
    from sluice.actors.executor.loader import load_weights
    from sluice.actors.executor.runner import ModelRunner

    weights_dtype, kv = resolve_dtypes(dtype, kv_dtype, device)
    config, weights = load_weights(Path(model_path), weights_dtype)
    shard_config, shard = shard_weights(config, weights, rank, tensor_parallel)
    del weights
    model = LlamaModel(shard_config, shard, device=device, dtype=weights_dtype, kv_dtype=kv)
    del shard
    attach_group(model, config.vocab_size, group)
    return ModelRunner(model=model, model_path=model_path, num_blocks=num_blocks,
                       block_size=block_size, max_model_len=max_model_len)


def _place(cpus: Sequence[int] | None, threads: int | None) -> None:
    """Pin this rank to `cpus` (when given) and run `threads` torch threads (default: one per
    CPU it may use)."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))


def serve_plans(socket, runner, monitor=None) -> None:
    """A rank other than 0: say ready on `socket`, then run every plan rank 0 sends on it
    until it says stop. With `monitor` (a remote rank's), rank 0's connection closing while
    this rank waits ends the group (`GroupGone`)."""
    socket.send_multipart([READY])
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    if monitor is not None:
        from zmq.utils.monitor import recv_monitor_message

        poller.register(monitor, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if monitor is not None and monitor in ready:
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                raise GroupGone("rank 0's connection closed")
        if socket not in ready:
            continue
        kind, *rest = socket.recv_multipart()
        if kind == STOP:
            return
        if kind == RESET:
            runner.reset_kv()
        elif kind == PLAN:
            runner.execute(CODEC.decode(rest[0]))  # its samples: only rank 0's count


def _follower_main(rank: int, world_size: int, port: int, runner_args: tuple,
                   cpus: Sequence[int] | None, threads: int | None, timeout_s: float,
                   startup_s: float, parent: int, setup: Callable[[], None] | None,
                   endpoint: str) -> None:
    """A rank other than 0 on rank 0's host: run every plan rank 0 sends, until it says
    stop. It exits with rank 0's process, and on any error (rank 0 then fails at once, its
    peer gone, rather than at the collective's deadline)."""
    import torch.distributed as dist

    from sluice.actors.executor.lifeline import PARENT_CHECK_SECONDS, die_with_parent

    die_with_parent(parent)
    if setup is not None:
        setup()
    else:  # stdout is rank 0's caller's (a report, a ready line): this rank's logs go aside
        import structlog

        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        _place(cpus, threads)
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        steps = init_group(rank, world_size, port, timeout_s=startup_s,
                           step_timeout_s=timeout_s)
        runner = _rank_runner(runner_args[0], rank, world_size, *runner_args[1:], steps)
        serve_plans(socket, runner)
        dist.destroy_process_group()
    except BaseException:
        # rank 0's process ending closes its connections before this one is told: that is
        # the group's end, not this rank's failure, and no traceback
        deadline = time.monotonic() + 2 * PARENT_CHECK_SECONDS
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.getppid() != parent:
            os._exit(0)
        raise


def _rank_cpus(cpus: Sequence[int] | None, rank: int, n: int) -> list[int] | None:
    """Rank `rank`'s slice of `cpus` (contiguous, as even as it goes); all of them where
    there are fewer CPUs than ranks."""
    if not cpus:
        return None
    cpus = list(cpus)
    return cpus[rank * len(cpus) // n:(rank + 1) * len(cpus) // n] or cpus


class TensorParallelRunner:
    """A ModelRunner for the engine whose model is split across `tensor_parallel` ranks:
    rank 0's runner in this process, each other rank a child process, or a process on
    another host that joined (`join`, see `rank_join.py`), running the same plans on its own
    shard and KV pool shard. Plans reach the ranks over ZeroMQ, a socket each; tensors meet
    in the group's collectives. Rank 0's sampled tokens are the group's. Everything else is
    rank 0's runner's.

    `threads` is the group's on this host: each local rank runs its share (default: this
    process's torch threads, shared out; this process keeps its share while the group
    lives). With `cpus`, each local rank is pinned to its slice of them. `rank_setup` (a
    module-level function) runs first in each child rank, e.g. to send its logs where this
    process's go. The group forms within `startup_timeout_s` (every rank joined, loaded and
    ready); a collective that waits longer than `timeout_s` fails the step; a rank
    that exits fails the next one. Either way the group is done: close it, start another."""

    def __init__(self, model_path: str | Path | None, tensor_parallel: int, *,
                 dtype: str = "auto", kv_dtype: str | None = None, device: str = "cpu",
                 num_blocks: int | None = None, block_size: int = 16,
                 max_model_len: int | None = None, threads: int | None = None,
                 cpus: Sequence[int] | None = None, kv_max_bytes: int | None = None,
                 timeout_s: float = 300.0, startup_timeout_s: float = 300.0,
                 rank_setup: Callable[[], None] | None = None,
                 join=None, log: Callable[..., None] | None = None):
        import tempfile

        import torch.distributed as dist

        from sluice.actors.executor.dtypes import dtype_name, resolve_dtypes
        from sluice.actors.executor.loader import read_model_config, resolve_model_path

        if torch.device(device).type != "cpu":
            raise TensorParallelError(
                f"tensor_parallel > 1 runs on the CPU (gloo) for now, not on {device!r}")
        if dist.is_initialized():
            raise TensorParallelError(
                "tensor_parallel > 1: this process already belongs to a torch.distributed "
                "group (close the other tensor-parallel engine first)")
        path = resolve_model_path(model_path)
        config = read_model_config(path)
        check_tensor_parallel(config, tensor_parallel)
        n = tensor_parallel
        remote = len(join.hosts) if join is not None else 0
        if remote >= n:
            raise TensorParallelError(f"tensor_parallel = {n} with {remote} ranks on other "
                                      f"hosts: rank 0 is this process")
        weights_dtype, kv = resolve_dtypes(dtype, kv_dtype, device)
        if not num_blocks:  # every rank's pool alike; not profiled (a forward is collective)
            shard = rank_config(config, 0, n)  # the most KV heads of any rank
            per_block = (2 * shard.num_layers * block_size * shard.num_kv_heads
                         * shard.head_dim * kv.itemsize)
            from sluice.actors.executor.memory import DEFAULT_CPU_KV_MAX_BYTES

            num_blocks = max(2, (kv_max_bytes or DEFAULT_CPU_KV_MAX_BYTES) // per_block)
        local = n - remote  # rank 0 and its children
        if threads is None and not cpus:
            threads = torch.get_num_threads()
        per_rank = max(1, threads // local) if threads else None
        # every rank resolves the dtypes alike: rank 0's choice, by name
        runner_args = (str(path), dtype_name(weights_dtype), dtype_name(kv), device,
                       num_blocks, block_size, max_model_len)
        self._context = zmq.Context()
        self._closed = True  # until the group has formed
        self._threads_before = torch.get_num_threads()
        self._followers = []
        self._desk = None
        self._sockets: list[tuple[object, bytes]] = []  # (socket, rank's identity) per rank
        self._dir = tempfile.mkdtemp(prefix="sluice-tp-")
        self._local = self._context.socket(zmq.ROUTER)
        self._local.setsockopt(zmq.LINGER, 0)
        self._local.setsockopt(zmq.ROUTER_MANDATORY, 1)
        endpoint = f"ipc://{self._dir}/plans.sock"
        self._local.bind(endpoint)
        context = multiprocessing.get_context("spawn")
        port = free_port()
        try:
            self._followers = [
                context.Process(target=_follower_main, daemon=True, name=f"sluice-tp-rank-{r}",
                                args=(r, n, port, runner_args, _rank_cpus(cpus, r, local),
                                      per_rank, timeout_s, startup_timeout_s, os.getpid(),
                                      rank_setup, endpoint))
                for r in range(1, local)]
            for process in self._followers:
                process.start()
            _place(_rank_cpus(cpus, 0, local), per_rank)
            deadline = time.monotonic() + startup_timeout_s
            if join is not None:
                self._desk = JoinDesk(self._context, join, n)
                welcome = {"world_size": n, "store_port": port, "dtype": runner_args[1],
                           "kv_dtype": runner_args[2], "num_blocks": num_blocks,
                           "block_size": block_size, "max_model_len": max_model_len,
                           "timeout_s": timeout_s, "startup_timeout_s": startup_timeout_s}
                joined = self._desk.admit(welcome, model_fingerprint(config), deadline, log)
            steps = init_group(0, n, port, timeout_s=startup_timeout_s, step_timeout_s=timeout_s)
            self._runner = _rank_runner(str(path), 0, n, *runner_args[1:], steps)
            self._sockets = self._await_ready(local, deadline)
            if join is not None:
                self._sockets += self._await_joined_ready(joined, deadline)
        except BaseException:
            self._end()
            raise
        self.tensor_parallel = n
        self._closed = False

    def _await_ready(self, local: int, deadline: float) -> list[tuple[object, bytes]]:
        """Each child rank's identity on the local socket, once it has said ready."""
        seen = []
        while len(seen) < local - 1:
            left = deadline - time.monotonic()
            if dead := self._dead():
                raise TensorParallelError(f"tensor_parallel rank {dead[0][0]} exited (code "
                                          f"{dead[0][1]}) before it was ready")
            if left <= 0:
                raise TensorParallelError("tensor_parallel: the other ranks were not ready "
                                          "in time")
            if self._local.poll(int(min(left, 0.5) * 1000)):
                identity, _ = self._local.recv_multipart()
                seen.append((self._local, identity))
        return seen

    def _await_joined_ready(self, joined: dict[int, bytes],
                            deadline: float) -> list[tuple[object, bytes]]:
        socket, waiting = self._desk.socket, set(joined.values())
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError("tensor_parallel: a rank on another host was not "
                                          "ready in time")
            if socket.poll(int(min(left, 0.5) * 1000)):
                identity, *_ = socket.recv_multipart()
                waiting.discard(identity)
        return [(socket, joined[r]) for r in sorted(joined)]

    def __getattr__(self, name):  # model_path, num_blocks, block_size, config, ...
        return getattr(self.__dict__["_runner"], name)

    @property
    def rank_pids(self) -> list[int]:
        """The process id of each rank, rank 0 (this process) first; 0 for a rank that
        joined from another host."""
        remote = len(self._desk.settings.hosts) if self._desk is not None else 0
        return [os.getpid(), *(p.pid for p in self._followers), *[0] * remote]

    def _dead(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of each child rank that has exited."""
        return [(r, p.exitcode) for r, p in enumerate(self._followers, 1) if not p.is_alive()]

    def _send(self, *frames: bytes) -> None:
        if self._closed:
            raise TensorParallelError("this tensor_parallel group is closed")
        if dead := self._dead():  # its collective would fail anyway; this says which rank
            raise TensorParallelError(f"tensor_parallel rank {dead[0][0]} has exited "
                                      f"(code {dead[0][1]})")
        for socket, identity in self._sockets:
            try:
                socket.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: that rank's connection is gone
                raise TensorParallelError(f"tensor_parallel: a rank cannot be reached "
                                          f"({exc})") from exc

    def execute(self, plan):
        self._send(PLAN, CODEC.encode(plan))
        try:
            return self._runner.execute(plan)
        except torch.OutOfMemoryError as exc:
            # the other ranks ran on (or wait in a collective): the group is out of step, and
            # only a new one serves; not the worker's "plan it smaller", which assumes one
            raise TensorParallelError(f"tensor_parallel rank 0 ran out of memory in a step: "
                                      f"{str(exc)[:200]}") from exc
        except RuntimeError as exc:  # a collective failed: name the rank that went, if one did
            if dead := self._dead():
                raise TensorParallelError(f"tensor_parallel rank {dead[0][0]} exited (code "
                                          f"{dead[0][1]}) during a step") from exc
            raise

    def reset_kv(self) -> None:
        self._send(RESET)
        self._runner.reset_kv()

    def close(self) -> None:
        """Stop the other ranks and leave the group (idempotent)."""
        if getattr(self, "_closed", True):
            return
        try:
            self._send(STOP)  # refused where a rank has exited: the others are ended below
            for process in self._followers:
                process.join(timeout=30)
        except Exception:
            pass
        finally:
            self._end()

    def _end(self) -> None:
        import shutil

        import torch.distributed as dist

        self._closed = True
        for process in self._followers:
            if process.is_alive():
                process.kill()
                process.join()
        if self._desk is not None:
            self._desk.close()
        self._local.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)


__all__ = [
    "TensorParallelError", "TensorParallelRunner", "attach_group", "check_tensor_parallel",
    "free_port", "greedy", "greedy_many", "greedy_tokens", "init_group", "load_rank_model",
    "rank_config", "serve_plans", "shard_weights", "vocab_shard_rows",
]
