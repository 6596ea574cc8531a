"""Requests by state, overall and per tenant, and the latest plan's composition."""

from __future__ import annotations

from rich.table import Table
from textual.widgets import Static

from sluice.ipc import messages as m

STATES = ("waiting", "prefilling", "decoding", "paused", "preempted")
HEADERS = {"prefilling": "prefill", "decoding": "decode", "preempted": "preempt"}


class QueuesPanel(Static):
    DEFAULT_CSS = "QueuesPanel { width: 1fr; height: auto; border: round $secondary; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "queues"
        self.plain = ""

    def show(self, snapshot: m.ControlSnapshot) -> None:
        detail = snapshot.detail or m.ConsoleDetail()
        queues = detail.queues
        table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
        table.add_column("tenant")
        for state in STATES:
            table.add_column(HEADERS.get(state, state), justify="right")
        table.add_row("[b]all[/b]", *(str(queues.get(s, 0)) for s in STATES))
        for name, tenant in sorted(detail.tenants.items()):
            table.add_row(name, *(str(tenant.queues.get(s, 0)) for s in STATES))
        step = detail.last_step
        counters = snapshot.status.counters
        lines = [" ".join(f"{s} {queues.get(s, 0)}" for s in STATES),
                 f"plan: prefill {step.prefill_tokens} tok, decode {step.decode_tokens}; "
                 f"preempted {counters.preemptions}, rejected {counters.rejected}"]
        self.plain = "\n".join(lines)
        grid = Table.grid()
        grid.add_row(table)
        grid.add_row(lines[1])
        self.update(grid)
