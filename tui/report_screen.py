"""The outcome of an operator command, with every finding (reconcile's discrepancies)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static

from sluice.ipc import messages as m


class ReportScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    ReportScreen { align: center middle; }
    ReportScreen > Vertical { width: 90; height: auto; max-height: 80%; border: thick $primary;
                              padding: 1 2; background: $surface; }
    """
    BINDINGS = [("escape", "dismiss", "close"), ("enter", "dismiss", "close"),
                ("q", "dismiss", "close")]

    def __init__(self, reply: m.CommandReply):
        super().__init__()
        self.reply = reply

    def compose(self) -> ComposeResult:
        reply = self.reply
        with Vertical():
            yield Label(f"{reply.command}: {'done' if reply.ok else 'refused'}", id="title")
            yield Static(reply.message, id="message")
            if reply.findings:
                yield Static("\n".join(f"- {f}" for f in reply.findings), id="findings")
            yield Label("(enter or escape closes)")
