"""`sluiced`: the daemon's entry point — flags, logging, signals, exit codes.

`sluiced serve` runs until SIGTERM or SIGINT, which drain it: no new admissions, running
requests get `drain_deadline` seconds to finish, then exit 0. SIGHUP re-reads the config's
tenants and limits. Exit codes, for systemd's `Restart=` and `StartLimit*` to decide on:

- 0: stopped by SIGTERM/SIGINT (Ctrl-C) after draining, or before it served (no traceback:
  the worker ignores SIGINT in a process group of its own; its daemon stops it).
- 70 (`EXIT_ESCALATED`): an actor exhausted its restart budget; systemd restarts the daemon.
- 75 (`EXIT_WORKER`): at boot, no worker passed its health check in `[worker]
  max_failed_starts` tries (bad weights, no device, out of memory); a restart may succeed
  later, and `StartLimitBurst=` bounds how often systemd tries. (At run time the same
  failure does not exit: the daemon stays up with its worker `failed`, see the README.)
- 78 (`EXIT_CONFIG`): the configuration is invalid, the runtime directory is unsafe,
  another daemon answers on the control socket, or a setting cannot work on this host (the
  model's files, an address or port, the device: `preflight.py`); restarting cannot fix it.
  All of it is checked before the model loads, and said in one line on stderr.

Once it serves, `sluiced ready listen=ADDR control=ADDR [metrics=PORT] [http=HOST:PORT]` goes
to stdout, then
the command to chat; systemd hears READY=1 (`notify.py`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import structlog
import trio

from sluice.daemon.logs import configure_logging
from sluice.daemon.heap import give_back_periodically, settle_collector
from sluice.daemon.notify import keepalive, notify, reloading

EXIT_ESCALATED = 70  # EX_SOFTWARE
EXIT_WORKER = 75  # EX_TEMPFAIL: the first worker never started
EXIT_CONFIG = 78  # EX_CONFIG


def build_parser() -> argparse.ArgumentParser:
    from sluice.daemon.cli import add_version, show_defaults

    parser = argparse.ArgumentParser(prog="sluiced", description="the sluice inference daemon")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model")
    serve.add_argument("--config", help="TOML config file")
    serve.add_argument("--model", help="model path, or 'default' for the embedded model")
    serve.add_argument("--listen", help="client address, tcp:// or ipc:// (default tcp://127.0.0.1:7340)")
    serve.add_argument("--control", help="control address (default: ipc socket in the runtime dir)")
    serve.add_argument("--executor", choices=("model", "null"),
                       help="'null' is a fake zero-cost model for measuring serving overhead")
    serve.add_argument("--num-blocks", type=int, help="KV pool size in blocks")
    serve.add_argument("--device", help="cpu or cuda")
    dtypes = ("auto", "float32", "bfloat16", "float16")
    serve.add_argument("--dtype", choices=dtypes,
                       help="weights and KV (default auto: bf16 where the hardware has it)")
    serve.add_argument("--kv-dtype", choices=dtypes, help="the KV pool's (default auto: as --dtype)")
    serve.add_argument("--deterministic", action="store_true", default=None,
                       help="greedy output independent of batch, chunking and prefix cache "
                            "(CPU; costs compute)")
    serve.add_argument("--tensor-parallel", type=int, metavar="N",
                       help="split the model across N worker rank processes (CPU, gloo)")
    serve.add_argument("--heartbeat-timeout", type=float, help="seconds of client silence")
    serve.add_argument("--pause-timeout", type=float, help="seconds a paused request may wait")
    serve.add_argument("--drain-deadline", type=float, help="seconds SIGTERM waits")
    serve.add_argument("--log-level", default=os.environ.get("SLUICE_LOG_LEVEL", "info"))
    serve.add_argument("--http", metavar="HOST:PORT",
                       help="serve the OpenAI-compatible HTTP API here (port 0: any free)")
    serve.add_argument("--metrics-port", type=int,
                       help="serve Prometheus /metrics and /health on this port (0: any free)")
    serve.add_argument("--usage-log", metavar="FILE",
                       help="append one JSON line per ended request here (reopened on SIGHUP)")
    from sluice.daemon import join

    join.add_parser(sub)
    return show_defaults(parser)


def _overrides(args: argparse.Namespace) -> dict:
    executor = args.executor
    return {
        "model": args.model,
        "listen": args.listen,
        "control": args.control,
        "executor": executor,
        "drain_deadline": args.drain_deadline,
        "metrics_port": args.metrics_port,
        "http.listen": args.http,
        "usage.path": args.usage_log,
        "stream.heartbeat_timeout": args.heartbeat_timeout,
        "stream.pause_timeout": args.pause_timeout,
        "worker.num_blocks": args.num_blocks if executor != "null" else None,
        "null.num_blocks": args.num_blocks if executor == "null" else None,
        "worker.device": args.device,
        "worker.dtype": args.dtype,
        "worker.kv_dtype": args.kv_dtype,
        "worker.deterministic": args.deterministic,
        "worker.tensor_parallel": args.tensor_parallel,
    }


class StopSignals:
    """SIGINT and SIGTERM while the event loop is not listening for them: before it starts
    they are remembered (the daemon then stops before it serves); once it has let go, the
    daemon is stopping already and they are ignored. Never a KeyboardInterrupt traceback."""

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self)

    def __call__(self, signum: int, frame: object) -> None:
        self.received = self.received or signum


async def serve(config, config_path: str | None = None, overrides: dict | None = None,
                stops: StopSignals | None = None) -> int:
    from sluice.daemon.server import Daemon

    daemon = Daemon(config)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        if stops is not None and stops.received:
            return 0
        structlog.get_logger("sluice.daemon").info(
            "starting", executor=config.executor, model=str(daemon.model_path))
        async with trio.open_nursery() as nursery:
            serving = trio.Event()
            nursery.start_soon(_on_signals, signals, daemon, serving, nursery.cancel_scope,
                               config_path, overrides)
            await nursery.start(daemon.run)
            settle_collector()  # what is loaded now lives as long as the daemon
            metrics = "" if daemon.metrics_port is None else f" metrics={daemon.metrics_port}"
            http = "" if daemon.http_address is None else f" http={daemon.http_address}"
            print(f"sluiced ready listen={daemon.listen_address} control={daemon.control_address}"
                  + metrics + http, flush=True)
            print(f"chat with it:  sluice chat --connect {daemon.listen_address}", flush=True)
            notify(f"READY=1\nSTATUS=serving on {daemon.listen_address}")
            serving.set()
            nursery.start_soon(keepalive, daemon.summary)
            nursery.start_soon(give_back_periodically)
    return 0


async def _on_signals(signals, daemon, serving: trio.Event, scope: trio.CancelScope,
                      config_path: str | None, overrides: dict | None) -> None:
    """SIGHUP reloads; SIGTERM or SIGINT drains a serving daemon and stops it, or stops one
    still starting (its worker is killed, nothing was admitted)."""
    log = structlog.get_logger("sluice.daemon")
    async for signum in signals:
        if signum == signal.SIGHUP:
            if serving.is_set():  # before, the daemon is starting with the config just read
                await reload(daemon, config_path, overrides)
            continue
        if not serving.is_set():
            log.info("stopped before serving", signal=signal.Signals(signum).name)
            scope.cancel()
            return
        notify("STOPPING=1\nSTATUS=draining")
        finished = await daemon.drain()
        log.info("stopped", drained=finished)
        scope.cancel()
        return


async def reload(daemon, config_path: str | None, overrides: dict | None) -> None:
    """SIGHUP: reopen the usage file, re-read the config file and apply its tenants (weights
    and limits)."""
    from sluice.daemon.config import ConfigFileError, load_config

    reloading()
    log = structlog.get_logger("sluice.daemon")
    daemon.reopen_usage_log()  # whatever the config says: a rotated file is let go now
    try:
        config = load_config(config_path, overrides)
        names = daemon.reload_tenants(config)
    except (ConfigFileError, TypeError, ValueError) as exc:
        log.error("reload failed; keeping the running config", error=str(exc))
    else:
        log.info("reloaded", tenants=names)
    notify(f"READY=1\nSTATUS={await daemon.summary()}")


def main(argv: list[str] | None = None) -> int:
    stops = StopSignals()
    stops.install()  # before the slow imports: Ctrl-C while starting stops quietly
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "worker":
        from sluice.daemon import join

        return join.run(args)
    from sluice.actors.runtime.supervisor import Escalation
    from sluice.actors.runtime.local_socket import SocketPathError
    from sluice.daemon.config import ConfigFileError, check_runtime_paths, load_config
    from sluice.daemon.preflight import StartupError, check_startup

    # everything is checked before the model loads or an actor starts; each mistake is one
    # line and exit 78, which systemd does not restart
    try:
        overrides = _overrides(args)
        config = load_config(args.config, overrides)
        check_runtime_paths(config)  # a live daemon on the control socket keeps it
        check_startup(config)
    except (ConfigFileError, SocketPathError, StartupError, TypeError, ValueError) as exc:
        print(f"sluiced: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if stops.received:
        return 0
    from sluice.daemon.server import WorkerStartFailed

    code = 0
    try:
        code = trio.run(serve, config, args.config, overrides, stops)
    except* Escalation as group:
        escalation = _first_leaf(group)
        cause = escalation.__cause__ and _first_leaf(escalation.__cause__)
        last = f" (last: {type(cause).__name__}: {cause})" if cause else ""
        print(f"sluiced: {escalation}{last}; exiting", file=sys.stderr)
        code = EXIT_ESCALATED
    except* WorkerStartFailed as group:
        print(f"sluiced: {_first_leaf(group)}; exiting", file=sys.stderr)
        code = EXIT_WORKER
    return code


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):  # nurseries nest their groups
        error = error.exceptions[0]
    return error


if __name__ == "__main__":
    sys.exit(main())
