"""Tenants: weight, share of the service so far, running, queued, tokens, preemptions, and
the limits each has (with what its token buckets hold now)."""

from __future__ import annotations

from textual.widgets import DataTable

from sluice.ipc import messages as m
from sluice.tui.limits import limits_text

COLUMNS = ("tenant", "weight", "share", "running", "queued", "tokens", "preemptions", "limits")


class TenantsTable(DataTable):
    DEFAULT_CSS = "TenantsTable { height: auto; max-height: 8; border: round $secondary; }"

    def __init__(self, **kwargs):
        super().__init__(cursor_type="none", **kwargs)
        self.border_title = "tenants"

    def on_mount(self) -> None:
        self.add_columns(*COLUMNS)

    def show(self, snapshot: m.ControlSnapshot) -> None:
        tenants = (snapshot.detail or m.ConsoleDetail()).tenants
        total = sum(t.totals.service for t in tenants.values()) or 1.0
        self.clear()
        for name, t in sorted(tenants.items()):
            used = t.totals
            self.add_row(name, f"{t.weight:g}", f"{used.service / total:.0%}", str(t.running),
                         str(t.waiting), str(used.prefill_tokens + used.decode_tokens),
                         str(used.preemptions), limits_text(t), key=name)
