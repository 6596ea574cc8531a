"""The daemon's settings: defaults, a TOML file, then command-line flags, in that order.

```toml
[daemon]
listen = "tcp://127.0.0.1:7340"
control = "ipc:///run/sluice/control.sock"
model = "default"
executor = "model"          # or "null"
drain_deadline = 30.0

[stream]                    # actors.front.stream.StreamConfig
heartbeat_timeout = 10.0
pause_timeout = 30.0

[worker]                    # actors.executor.actor.WorkerSpec
num_blocks = 2048

[null]                      # the fake executor's pool and context
num_blocks = 16384
max_model_len = 4096

[scheduler]                 # actors.scheduler.SchedulerConfig
policy = "fair"

[limits]                    # actors.front.limits.Limits: what one client can make the daemon hold
max_frame_bytes = 4194304

[usage]                     # UsageSettings: the usage file (off)
path = "/var/lib/sluice/usage.jsonl"

[http]                      # actors.http.front.HttpSettings: the OpenAI-compatible front (off)
listen = "127.0.0.1:8000"
[http.tenants]
interactive = ["<API key>"]
```
Unknown keys are errors naming the key. Nothing here starts anything.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.actors.executor.actor import WorkerSpec
from sluice.actors.http.front import HttpSettings
from sluice.actors.front.limits import Limits
from sluice.actors.runtime.local_socket import (
    UnsafeDirectory,
    check_private_directory,
    prepare_private_socket,
)
from sluice.actors.scheduler import ConfigError, SchedulerConfig
from sluice.actors.front.stream import StreamConfig

DEFAULT_LISTEN = "tcp://127.0.0.1:7340"
DEFAULT_CONFIG_PATH = Path("/etc/sluice/sluiced.toml")


class ConfigFileError(ValueError):
    """The config file is unreadable or names an unknown or mistyped key."""


def runtime_dir() -> Path:
    """`$XDG_RUNTIME_DIR/sluice`, or a per-user directory under the temp dir.

    The directory holds the control and worker sockets, so it must be this user's and not
    writable by group or others (`UnsafeDirectory` otherwise): under a shared temp dir anyone
    could have made `sluice-<uid>` first. systemd's `RuntimeDirectory=` (mode 0750) passes.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "sluice" if base else Path(tempfile.gettempdir()) / f"sluice-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UnsafeDirectory(f"runtime directory {path}: {exc.strerror}") from None
    check_private_directory(path, "runtime directory")
    return path


def check_runtime_paths(config: DaemonConfig) -> None:
    """Refuse to start where the daemon's sockets could not be private, or another daemon
    already answers on the control socket; a stale control socket is removed.

    Raises `SocketPathError` with a message naming the path and what is wrong with it."""
    if config.executor == "model" and config.worker.runtime_dir is None:
        runtime_dir()  # the worker's socket lives there
    prepare_private_socket(config.control_address)


def default_control_address() -> str:
    return f"ipc://{runtime_dir() / 'control.sock'}"


@dataclass(frozen=True)
class NullSettings:
    num_blocks: int = 16384
    block_size: int = 16
    max_model_len: int = 4096
    text: str = " the quick brown fox jumps over the lazy dog"  # tokenized: the token cycle


@dataclass(frozen=True)
class AuthSettings:
    """CURVE on the client socket: the server's secret key and each tenant's client keys.

    ```toml
    [auth]
    server_secret_key = "..."          # Z85, 40 characters (`sluice keygen` style pair)
    [auth.tenants]
    chat = ["<client public key, Z85>", ...]
    ```
    With a server key set, only listed client keys connect, and a request is attributed to
    the tenant of its key whatever tenant it names.

    `server_secret_key_file` names a file holding the key instead, read at start (and on
    reload); a relative name is a systemd credential, looked up in `$CREDENTIALS_DIRECTORY`
    (the shipped unit's `LoadCredential=`), so the key need not sit in the config file."""

    server_secret_key: str | None = None
    tenants: dict[str, Any] = field(default_factory=dict)  # tenant -> [public keys, Z85]
    server_secret_key_file: str | None = None


@dataclass(frozen=True)
class UsageSettings:
    # one JSON line per ended request, appended and flushed as it ends (`sluice usage` sums
    # them); None: records go to the log only
    path: str | None = None


@dataclass(frozen=True)
class DaemonConfig:
    listen: str = DEFAULT_LISTEN
    control: str | None = None  # None: an ipc socket in the runtime directory
    model: str | None = None  # None or "default": the embedded model
    executor: str = "model"  # model | null
    drain_deadline: float = 30.0  # seconds SIGTERM waits for running requests
    metrics_port: int | None = None  # Prometheus text and /health over HTTP; None: off
    metrics_host: str = "127.0.0.1"
    debug_faults: bool = False  # accept InjectFault on the control socket (tests only)
    stream: StreamConfig = StreamConfig()
    worker: WorkerSpec = WorkerSpec()
    null: NullSettings = NullSettings()
    scheduler: dict[str, Any] = field(default_factory=dict)
    auth: AuthSettings = AuthSettings()
    limits: Limits = Limits()
    http: HttpSettings = HttpSettings()
    usage: UsageSettings = UsageSettings()

    @property
    def control_address(self) -> str:
        return self.control or default_control_address()


_SECTIONS = {"stream": StreamConfig, "worker": WorkerSpec, "null": NullSettings,
             "auth": AuthSettings, "limits": Limits, "http": HttpSettings,
             "usage": UsageSettings}


Z85_KEY_LENGTH = 40  # a 32-byte CURVE key in Z85


def read_secret_key(auth: AuthSettings) -> AuthSettings:
    """Fill `server_secret_key` from `server_secret_key_file`; errors name the file, never
    the key."""
    name = auth.server_secret_key_file
    if name is None:
        return auth
    if auth.server_secret_key is not None:
        raise ConfigFileError("auth: set server_secret_key or server_secret_key_file, not both")
    path, key = read_secret_file("auth.server_secret_key_file", name)
    key = key.strip()
    if len(key) != Z85_KEY_LENGTH:
        raise ConfigFileError(f"auth.server_secret_key_file: {path} does not hold a Z85 CURVE "
                              f"secret key ({Z85_KEY_LENGTH} characters)")
    return dataclasses.replace(auth, server_secret_key=key)


def read_secret_file(setting: str, name: str) -> tuple[Path, str]:
    """(path, text) of a secret file a setting names; a relative name is a systemd
    credential, looked up in `$CREDENTIALS_DIRECTORY`. Errors name the file, never its text."""
    path = Path(name)
    if not path.is_absolute():
        credentials = os.environ.get("CREDENTIALS_DIRECTORY")
        if not credentials:
            raise ConfigFileError(f"{setting}: {name!r} is relative, which names a systemd "
                                  "credential, but $CREDENTIALS_DIRECTORY is not set "
                                  "(LoadCredential= in the unit)")
        path = Path(credentials) / path
    try:
        info = os.stat(path)
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{setting}: {path}: {exc}") from None
    if info.st_mode & 0o007:
        raise ConfigFileError(f"{setting}: {path} is readable by others; make it 0600 or 0640")
    return path, text


def read_api_keys(http: HttpSettings) -> HttpSettings:
    """Add the keys of `tenant_keys_file` (lines `TENANT KEY`; `#` starts a comment) to
    `tenants`. Errors name the file and the line, never a key."""
    if http.tenant_keys_file is None:
        return http
    path, text = read_secret_file("http.tenant_keys_file", http.tenant_keys_file)
    tenants = {tenant: list(keys) for tenant, keys in http.tenants.items()}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise ConfigFileError(f"http.tenant_keys_file: {path} line {number}: expected "
                                  "TENANT KEY")
        tenants.setdefault(words[0], []).append(words[1])
    return dataclasses.replace(http, tenants=tenants)


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> DaemonConfig:
    """Read `path` (if given) and apply flag overrides (`None` values are ignored)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigFileError(f"{path}: {exc}") from None
    unknown = set(data) - {"daemon", "scheduler", *_SECTIONS}
    if unknown:
        raise ConfigFileError(f"unknown section(s): {', '.join(sorted(unknown))}")
    for name in ("daemon", "scheduler", *_SECTIONS):
        if not isinstance(data.get(name, {}), dict):
            raise ConfigFileError(f"{name}: must be a table ([{name}]), got {_shown(data[name])}")
    values: dict[str, Any] = dict(data.get("daemon", {}))
    top = {f.name for f in dataclasses.fields(DaemonConfig)} - {"scheduler", *_SECTIONS}
    bad = set(values) - top
    if bad:
        raise ConfigFileError(f"daemon: unknown key(s) {', '.join(sorted(bad))}")
    check_types("daemon", DaemonConfig, values)
    for name, cls in _SECTIONS.items():
        section = data.get(name, {})
        known = {f.name for f in dataclasses.fields(cls)}
        bad = set(section) - known
        if bad:
            raise ConfigFileError(f"{name}: unknown key(s) {', '.join(sorted(bad))}")
        values[name] = _section(name, cls, section)
    values["scheduler"] = dict(data.get("scheduler", {}))
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        if section:
            check_types(section, _SECTIONS[section], {name: value})
            values[section] = dataclasses.replace(values[section], **{name: value})
        else:
            check_types("daemon", DaemonConfig, {name: value})
            values[name] = value
    _check_daemon_values(values)
    try:  # what the scheduler core will be built from, once the worker says its pool
        SchedulerConfig.from_dict({**values["scheduler"], "kv_blocks": 1})
    except ConfigError as exc:
        message = str(exc)
        raise ConfigFileError(message if message.startswith("scheduler") else
                              f"scheduler.{message}") from None
    values["auth"] = read_secret_key(values["auth"])
    values["http"] = read_api_keys(values["http"])
    if values.get("model") == "default":
        values["model"] = None
    if values.get("executor", "model") not in ("model", "null"):
        raise ConfigFileError(f"executor: must be model or null, got {values['executor']!r}")
    return DaemonConfig(**values)


MAX_PORT = 65535


def _check_daemon_values(values: dict[str, Any]) -> None:
    """The `[daemon]` values' ranges (their types are checked already)."""
    deadline = values.get("drain_deadline", DaemonConfig.drain_deadline)
    if deadline < 0:
        raise ConfigFileError(f"daemon.drain_deadline: must be a number of seconds >= 0, "
                              f"got {deadline!r}")
    port = values.get("metrics_port")
    if port is not None and not 0 <= port <= MAX_PORT:
        raise ConfigFileError(f"daemon.metrics_port: must be a port from 0 to {MAX_PORT} "
                              f"(0: any free), got {port!r}")


def _section(name: str, cls: type, values: dict[str, Any]) -> Any:
    """The section's dataclass; a mistyped value is named by the class's own check where it
    has one for that value, else by `check_types`."""
    try:
        check_types(name, cls, values)
    except ConfigFileError as mistyped:
        try:
            cls(**values)
        except ValueError as exc:
            raise ConfigFileError(str(exc)) from None
        except Exception:  # noqa: BLE001 - what a check never meant for this type raised
            pass
        raise mistyped from None
    return cls(**values)


def check_types(section: str, cls: type, values: dict[str, Any]) -> None:
    """Each value has the type its dataclass field declares, or `ConfigFileError` names it.

    A TOML file can only hold strings, numbers, booleans, arrays, tables and dates, so these
    are the types the settings use; a field of another type is left to its class's checks.
    A float setting takes an integer, never NaN."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        hint = hints.get(name)
        if hint is not None and not _fits(value, hint):
            raise ConfigFileError(f"{section}.{name}: must be {_described(hint)}, "
                                  f"got {_shown(value)}")


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, arm) for arm in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and not math.isnan(value))
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(_fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict)
    return True


def _described(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_described(arm) for arm in args if arm is not type(None))
    if origin is tuple:
        return f"a list of {_described(args[0]).removeprefix('an ').removeprefix('a ')}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a table"}.get(origin or hint, str(hint))


def _shown(value: Any) -> str:
    """A value as the error shows it: short, with its TOML kind when that is the problem."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = {bool: "a boolean", str: "a string", list: "an array", dict: "a table"}.get(
        type(value))
    return f"{text} ({kind})" if kind else text
