"""`sluice top`: the live console over the control socket.

The app owns a `ControlClient`; each snapshot arrives as a replaceable `SnapshotArrived`
message (a slow terminal skips to the newest instead of falling behind) and every panel
redraws from it. Commands that change the daemon ask for confirmation first; their replies
are shown in a dialog. Without snapshots the status bar says "disconnected" and the client
keeps renewing its subscription until the daemon is back.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer

from sluice.ipc import messages as m
from sluice.tui.client import ControlClient
from sluice.tui.confirm_screen import ConfirmScreen
from sluice.tui.help_screen import HelpScreen
from sluice.tui.kv_panel import KVPanel
from sluice.tui.latency_panel import LatencyPanel
from sluice.tui.queues_panel import QueuesPanel
from sluice.tui.report_screen import ReportScreen
from sluice.tui.requests_table import RequestsTable
from sluice.tui.status_bar import StatusBar
from sluice.tui.tenants_table import TenantsTable


@dataclass
class SnapshotArrived(Message):
    snapshot: m.ControlSnapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotArrived)


@dataclass
class ConnectionChanged(Message):
    connected: bool


class SluiceTop(App):
    TITLE = "sluice top"
    CSS = "Horizontal#top-row { height: auto; }"
    BINDINGS = [
        ("d", "drain", "drain"), ("r", "resume", "resume"), ("n", "reconcile", "reconcile"),
        ("w", "recover", "recover"), ("x", "cancel_request", "cancel"),
        ("question_mark", "help", "help"), ("q", "quit", "quit"),
    ]

    def __init__(self, address: str, *, connect: bool = True):
        super().__init__()
        self.address = address
        self.connect = connect  # False: shows only what `apply_snapshot` is given
        self.snapshot: m.ControlSnapshot | None = None
        self.connected = False
        self.last_reply: m.CommandReply | None = None
        self.client: ControlClient | None = None

    def compose(self) -> ComposeResult:
        # kept as attributes: snapshots must reach the panels while a dialog is on top
        self.status_bar = StatusBar(self.address, id="status")
        self.requests_table = RequestsTable(id="requests")
        self.panels = (QueuesPanel(id="queues"), KVPanel(id="kv"), LatencyPanel(id="latency"),
                       TenantsTable(id="tenants"), self.requests_table)
        yield self.status_bar
        with Horizontal(id="top-row"):
            yield self.panels[0]
            yield self.panels[1]
        yield from self.panels[2:]
        yield Footer()

    def on_ready(self) -> None:
        self.status_bar.show(None, False)
        if self.connect:
            self.client = ControlClient(
                self.address, on_snapshot=lambda s: self.post_message(SnapshotArrived(s)),
                on_connection=lambda up: self.post_message(ConnectionChanged(up)))
            self.client.start()

    async def on_unmount(self) -> None:
        if self.client is not None:
            await self.client.close()

    def on_snapshot_arrived(self, message: SnapshotArrived) -> None:
        self.connected = True
        self.apply_snapshot(message.snapshot)

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        self.connected = message.connected
        self.status_bar.show(self.snapshot, self.connected)

    def apply_snapshot(self, snapshot: m.ControlSnapshot, *, connected: bool = True) -> None:
        """Redraw every panel from one snapshot."""
        self.snapshot = snapshot
        self.connected = connected
        self.status_bar.show(snapshot, connected)
        for panel in self.panels:
            panel.show(snapshot)

    # -- commands -----------------------------------------------------------------------------

    def _confirm_then(self, question: str, command: object) -> None:
        async def answered(yes: bool | None) -> None:
            if yes:
                await self.run_command(command)

        self.push_screen(ConfirmScreen(question), answered)

    async def run_command(self, command: object) -> m.CommandReply:
        try:
            reply = await self.client.command(command)
        except (TimeoutError, AttributeError):
            reply = m.CommandReply(type(command).__name__, False, "the daemon did not answer")
        self.last_reply = reply
        if reply.findings or not reply.ok:
            await self.push_screen(ReportScreen(reply))
        else:
            self.notify(reply.message, title=reply.command)
        return reply

    def action_drain(self) -> None:
        self._confirm_then("Drain the daemon? New requests are rejected; running ones finish.",
                           m.DrainCommand())

    def action_resume(self) -> None:
        self._confirm_then("Resume admitting new requests?", m.ResumeCommand())

    def action_reconcile(self) -> None:
        self._confirm_then("Reconcile? Orphaned requests and KV blocks are freed.",
                           m.ReconcileCommand())

    def action_recover(self) -> None:
        self._confirm_then("Recover? The worker restarts; running requests recompute.",
                           m.RecoverCommand())

    def action_cancel_request(self) -> None:
        request_id = self.requests_table.selected_id()
        if request_id is None:
            self.notify("no request selected", severity="warning")
            return
        self._confirm_then(f"Cancel request {request_id}?", m.CancelCommand(request_id))

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
