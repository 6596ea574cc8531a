"""A rank of a tensor-parallel group on another host (`sluiced worker --join ADDR --rank R`):
join the daemon's worker at its CURVE join desk (`rank_join.py`), load this rank's shard of
the model, serve the group's plans until the group ends (rank 0 gone, a collective failed),
then join again, for the next group the daemon's worker starts."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack
import zmq

from sluice.actors.executor import tensor_parallel as tp
from sluice.actors.executor.rank_join import (
    EX_NOPERM, JOIN, REFUSED, WELCOME, GroupGone, JoinRefused, model_fingerprint,
)  # fmt: skip


def serve_joined_rank(address: str, rank: int, *, model: str | None, server_key: str,
                      keypair: tuple[str, str], threads: int | None = None,
                      cpus: list[int] | None = None, world_size: int | None = None,
                      once: bool = False, log: Callable[..., None] = lambda *a, **k: None,
                      retry_s: float = 1.0) -> int:
    """Join the group at `address` as `rank`, serve its plans, and join again when it ends
    (once: return after the first group). Returns 0, or EX_NOPERM when the daemon refuses
    this rank's key, address or model."""
    import torch.distributed as dist

    from sluice.actors.executor.model_files import read_model_config, resolve_model_path

    path = resolve_model_path(model)
    fingerprint = model_fingerprint(read_model_config(path))
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    tp._place(cpus, threads)
    context = zmq.Context()
    try:
        while True:
            socket = _client(context, server_key, keypair)
            monitor = socket.get_monitor_socket()
            socket.connect(address)  # after the monitor: its handshake is the cue to join
            try:
                welcome = _join(socket, monitor, rank, fingerprint, retry_s)
                if world_size is not None and welcome["world_size"] != world_size:
                    raise JoinRefused(f"the group has {welcome['world_size']} ranks, not the "
                                      f"{world_size} this rank was told (WORLD_SIZE)")
                log("joined", rank=rank, world_size=welcome["world_size"])
                try:  # a group that does not form (rank 0 gone since) is joined again too
                    steps = tp.init_group(rank, welcome["world_size"], welcome["store_port"],
                                          timeout_s=welcome["startup_timeout_s"], host=host,
                                          step_timeout_s=welcome["timeout_s"])
                    runner = tp._rank_runner(
                        str(path), rank, welcome["world_size"], welcome["dtype"],
                        welcome["kv_dtype"], "cpu", welcome["num_blocks"],
                        welcome["block_size"], welcome["max_model_len"], steps)
                    tp.serve_plans(socket, runner, monitor)
                    log("group ended", rank=rank)
                except (RuntimeError, ConnectionError, GroupGone) as exc:
                    log("group ended", rank=rank, reason=f"{type(exc).__name__}: {exc}"[:300])
                finally:
                    runner = None
                    if dist.is_initialized():
                        dist.destroy_process_group()
            finally:
                socket.disable_monitor()
                monitor.close(linger=0)
                socket.close(linger=0)
            if once:
                return 0
    except JoinRefused as exc:
        log("join refused", rank=rank, reason=str(exc))
        return EX_NOPERM
    finally:
        context.term()


def _client(context: zmq.Context, server_key: str, keypair: tuple[str, str]) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.curve_serverkey = server_key.encode()
    socket.curve_publickey, socket.curve_secretkey = (k.encode() for k in keypair)
    # a peer host that vanishes without closing its connections is noticed too
    socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    return socket


def _join(socket: zmq.Socket, monitor: zmq.Socket, rank: int, fingerprint: str,
          retry_s: float) -> dict:
    """Ask to join once connected, again on each new connection (rank 0 may not be up yet,
    or restart): its welcome, or JoinRefused."""
    from zmq.utils.monitor import recv_monitor_message

    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(int(retry_s * 1000)))
        if monitor in ready:
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise JoinRefused("the daemon refused this rank's key or address (CURVE "
                                  "authentication failed)")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # a fresh connection (rank 0 restarted): ask again on it
                socket.send_multipart([JOIN, str(rank).encode(), fingerprint.encode()])
        if socket in ready:
            kind, *rest = socket.recv_multipart()
            if kind == WELCOME:
                return msgpack.unpackb(rest[0])
            if kind == REFUSED:
                reason = rest[0].decode(errors="replace") if rest else "no reason given"
                if "has joined already" in reason:  # an earlier group's seat, soon free
                    time.sleep(retry_s)
                    socket.send_multipart([JOIN, str(rank).encode(), fingerprint.encode()])
                    continue
                raise JoinRefused(reason)


__all__ = ["serve_joined_rank"]
