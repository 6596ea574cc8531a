"""The top line of the console: connection, daemon state, worker health (with the reason
when the worker `failed` to start), connections."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from sluice.ipc import messages as m


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $primary-background; }
    StatusBar.-disconnected { background: $error; color: $text; }
    """

    def __init__(self, address: str, **kwargs):
        super().__init__(**kwargs)
        self.address = address
        self.plain = ""

    def show(self, snapshot: m.ControlSnapshot | None, connected: bool) -> None:
        self.set_class(not connected, "-disconnected")
        text = Text()
        if not connected:
            text.append(" DISCONNECTED ", style="bold reverse")
            text.append(f" reconnecting to {self.address} ...")
        elif snapshot is not None:
            status = snapshot.status
            worker = status.worker
            text.append(f" {status.state.upper()} ", style="bold reverse")
            worker_style = "green" if worker.state == "ready" else "bold red"
            text.append("  worker ")
            text.append(worker.state, style=worker_style)
            if worker.state == "failed":  # why, and what the operator can do about it
                text.append(f" ({worker.failure[:80]}; w retries now)", style="bold red")
            if worker.dtype:  # the model worker's precision; the null executor has none
                kv = "" if worker.kv_dtype == worker.dtype else f", kv {worker.kv_dtype}"
                text.append(f" {worker.dtype}{kv}")
            text.append(f" (restarts {worker.restarts})  connections {status.connections}"
                        f"  {self.address}")
        self.plain = text.plain
        self.update(text)
