"""What `sluiced serve` checks before it loads a model or starts an actor: the model's files,
the device, and every address it will bind (syntax, port range, and a trial bind).

Each check raises `StartupError`, one line naming the setting, its value and the fix; `main`
prints it and exits 78 (EX_CONFIG), which systemd does not restart. A port is tried by binding
it (with `SO_REUSEADDR`, as libzmq and hypercorn bind) and closing it at once, so a port that
another program holds is refused here, not by an actor crashing until the daemon escalates.
Types, ranges and unknown keys are checked when the config is read (`config.py`).
"""

from __future__ import annotations

import errno
import json
import re
import socket
import subprocess
import sys

from sluice.actors.runtime.local_socket import answers, ipc_path
from sluice.daemon.config import MAX_PORT, DaemonConfig

DEVICE = re.compile(r"cpu|cuda(:\d+)?")
WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::")


class StartupError(ValueError):
    """A setting that cannot work on this host; the message names it and the fix."""


def check_startup(config: DaemonConfig) -> None:
    """Every check below, the addresses first (they need no torch); raises `StartupError`."""
    binds: dict[str, tuple[str, int]] = {}
    binds["daemon.listen"] = check_zmq_address("daemon.listen", config.listen)
    if config.control is not None:
        binds["daemon.control"] = check_zmq_address("daemon.control", config.control)
    if config.http.listen is not None:
        binds["http.listen"] = check_http_address(config.http.listen)
    if config.metrics_port is not None:
        binds["daemon.metrics_port"] = (config.metrics_host, config.metrics_port)
    if config.executor == "model" and config.worker.join_hosts:
        binds["worker.join_listen"] = check_zmq_address("worker.join_listen",
                                                        config.worker.join_listen)
    _check_distinct(binds)
    for setting, (host, port) in binds.items():
        if port:
            try_bind(setting, host, port)
    check_model(config)
    if config.executor == "model":
        check_device(config.worker.device)


def check_model(config: DaemonConfig) -> None:
    """The model (and the worker's, when `[worker] model` names another) exists and reads as
    a supported GGUF file or Hugging Face folder."""
    from sluice.actors.executor.model_files import (ModelLoadError, read_model_config,
                                                    resolve_model_path)

    models = {"": config.model}
    if config.executor == "model" and config.worker.model not in (None, config.model):
        models["worker.model: "] = config.worker.model
    for prefix, model in models.items():
        try:
            model_config = read_model_config(resolve_model_path(model))
        except ModelLoadError as exc:
            raise StartupError(f"{prefix}{exc}") from None
    if config.executor == "model" and config.worker.tensor_parallel > 1:
        from sluice.actors.executor.shards import TensorParallelError, check_tensor_parallel

        try:  # the worker's model: the last one read
            check_tensor_parallel(model_config, config.worker.tensor_parallel)
        except TensorParallelError as exc:
            raise StartupError(f"worker.{exc}") from None


# asked of a child Python: the daemon process never imports torch (only its worker runs a
# model), and torch's CUDA count is what the worker will see
_CUDA_PROBE = ("import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, "
               "torch.cuda.device_count() if torch.version.cuda else 0]))")


def check_device(device: str) -> None:
    """`cpu`, or a CUDA device torch can see, asked of torch in a child process."""
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise StartupError(f"worker.device: must be cpu, cuda or cuda:N, got {device!r}")
    if device == "cpu":
        return
    try:
        probe = subprocess.run([sys.executable, "-P", "-c", _CUDA_PROBE], capture_output=True,
                               text=True, timeout=300, check=True)
        version, cuda, count = json.loads(probe.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        lines = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()
        raise StartupError(f"worker.device: {device!r}, but torch could not be asked which "
                           f"CUDA devices it sees ({lines[-1] if lines else type(exc).__name__})"
                           ) from None
    if cuda is None:
        raise StartupError(f"worker.device: {device!r}, but this torch ({version}) is "
                           "built without CUDA; use device = \"cpu\" (--device cpu) or a CUDA "
                           "build of torch")
    if count == 0:
        raise StartupError(f"worker.device: {device!r}, but torch sees no CUDA device (check "
                           "the driver and CUDA_VISIBLE_DEVICES); use device = \"cpu\" "
                           "(--device cpu)")
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise StartupError(f"worker.device: {device!r}, but torch sees {count} CUDA device(s): "
                           f"use cuda:0 to cuda:{count - 1}")


def check_zmq_address(setting: str, address: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` (PORT 0 or `*`: any free) or `ipc://PATH`: (host, port) to try, or
    ("", 0) for an ipc socket, whose directory must exist and where no daemon may answer."""
    example = "tcp://127.0.0.1:7340 or ipc:///run/sluice/sluiced.sock"
    if address.startswith("ipc://"):
        path = ipc_path(address)
        if not str(path):
            raise StartupError(f"{setting}: {address!r} names no socket file; give {example}")
        if not path.parent.is_dir():
            raise StartupError(f"{setting}: {address!r}: the directory {path.parent} does not "
                               "exist; create it or pick another path")
        try:
            live = setting != "daemon.control" and answers(path)  # control: check_runtime_paths
        except OSError as exc:
            raise StartupError(f"{setting}: {address!r}: {exc}; pick another path") from None
        if live:
            raise StartupError(f"{setting}: {address!r}: another process serves on that "
                               "socket; stop it or pick another path")
        return "", 0
    if not address.startswith("tcp://"):
        raise StartupError(f"{setting}: {address!r} is not an address this daemon can bind; "
                           f"give {example}")
    return _host_port(setting, address[len("tcp://"):], address, example, allow_star=True)


def check_http_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (`[V6]:PORT`; PORT 0: any free), as the HTTP front binds it."""
    example = "127.0.0.1:8000 (port 0: any free)"
    if "://" in address:
        raise StartupError(f"http.listen: {address!r} is a URL; give HOST:PORT without the "
                           f"scheme, e.g. {example}")
    return _host_port("http.listen", address, address, example, allow_star=False)


def _host_port(setting: str, text: str, address: str, example: str, *,
               allow_star: bool) -> tuple[str, int]:
    host, colon, port_text = text.rpartition(":")
    if not colon or not host:
        raise StartupError(f"{setting}: {address!r} has no port; give HOST:PORT, e.g. {example}")
    host = host.removeprefix("[").removesuffix("]")
    if allow_star and port_text == "*":
        return host, 0
    if not port_text.isdigit() or not 0 <= int(port_text) <= MAX_PORT:
        raise StartupError(f"{setting}: port {port_text!r} of {address!r} is not a port from 0 "
                           f"to {MAX_PORT}; e.g. {example}")
    return host, int(port_text)


def _check_distinct(binds: dict[str, tuple[str, int]]) -> None:
    """No two listeners on one port (the trial binds let go of each port before the next)."""
    seen: dict[int, tuple[str, str]] = {}
    for setting, (host, port) in binds.items():
        if not port:
            continue
        if port in seen:
            other, other_host = seen[port]
            if host == other_host or host in WILDCARD_HOSTS or other_host in WILDCARD_HOSTS:
                raise StartupError(f"{setting}: port {port} is also {other}'s; give each "
                                   "listener its own port")
        seen[port] = (setting, host)


def try_bind(setting: str, host: str, port: int) -> None:
    """Bind host:port and let it go: the port is free and the host is this machine's."""
    bind_host = "" if host in ("*", "") else host
    try:
        infos = socket.getaddrinfo(bind_host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        if _is_interface(host):  # libzmq binds `tcp://eth0:PORT` by interface name
            return
        raise StartupError(f"{setting}: host {host!r} cannot be resolved ({exc.strerror}); "
                           "give an IP address or a name of this machine") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            fix = {errno.EADDRINUSE: "stop what uses it or pick another port (0: any free)",
                   errno.EADDRNOTAVAIL: "give an address of this machine",
                   errno.EACCES: "pick a port above 1023, or give the daemon the right to "
                                 "bind it"}.get(exc.errno, "pick another address")
            raise StartupError(f"{setting}: cannot listen on {host or '*'}:{port}: "
                               f"{exc.strerror}; {fix}") from None


def _is_interface(name: str) -> bool:
    try:
        socket.if_nametoindex(name)
    except OSError:
        return False
    return True
