"""Live requests: id, tenant, state, age, tokens, KV blocks, paused. The cursor row is the
one `x` cancels."""

from __future__ import annotations

from textual.widgets import DataTable

from sluice.ipc import messages as m

COLUMNS = ("id", "tenant", "state", "age", "prompt", "output", "blocks", "paused")


class RequestsTable(DataTable):
    DEFAULT_CSS = "RequestsTable { height: 1fr; border: round $secondary; }"

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", **kwargs)
        self.border_title = "requests"
        self.ids: list[str] = []

    def on_mount(self) -> None:
        self.add_columns(*COLUMNS)

    def show(self, snapshot: m.ControlSnapshot) -> None:
        requests = (snapshot.detail or m.ConsoleDetail()).requests
        selected = self.selected_id()
        self.clear()
        self.ids = [r.request_id for r in requests]
        for r in requests:
            self.add_row(r.request_id, r.tenant, r.state, f"{r.age:.1f}s", str(r.prompt_tokens),
                         str(r.output_tokens), str(r.blocks), "yes" if r.paused else "",
                         key=r.request_id)
        if selected in self.ids:
            self.move_cursor(row=self.ids.index(selected))

    def selected_id(self) -> str | None:
        if not self.ids or self.cursor_row is None or self.cursor_row >= len(self.ids):
            return None
        return self.ids[self.cursor_row]
