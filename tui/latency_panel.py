"""Throughput, time to first token and inter-token latency, each with its recent history."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline

from sluice.ipc import messages as m

HISTORY = 120

SERIES = (  # id, title, how to read it from the snapshot's latency summary
    ("throughput", "tokens/s", lambda lat: lat.tokens_per_second),
    ("ttft", "TTFT p50", lambda lat: lat.ttft.p50),
    ("itl", "ITL p50", lambda lat: lat.itl.p50),
)


def _format(series: str, value: float) -> str:
    return f"{value:,.0f}" if series == "throughput" else f"{value * 1000:.1f} ms"


class LatencyPanel(Horizontal):
    DEFAULT_CSS = """
    LatencyPanel { height: 5; border: round $secondary; }
    LatencyPanel Vertical { width: 1fr; padding: 0 1; }
    LatencyPanel Sparkline { height: 2; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "latency"
        self.history = {name: deque([0.0], maxlen=HISTORY) for name, _, _ in SERIES}
        self.plain = ""

    def compose(self) -> ComposeResult:
        self.labels = {name: Label(title, id=f"{name}-label") for name, title, _ in SERIES}
        self.sparklines = {name: Sparkline([0.0], id=f"{name}-spark") for name, _, _ in SERIES}
        for name, _, _ in SERIES:
            with Vertical():
                yield self.labels[name]
                yield self.sparklines[name]

    def show(self, snapshot: m.ControlSnapshot) -> None:
        latency = (snapshot.detail or m.ConsoleDetail()).latency
        parts = []
        for name, title, read in SERIES:
            value = float(read(latency))
            self.history[name].append(value)
            label = f"{title} {_format(name, value)}"
            parts.append(label)
            self.labels[name].update(label)
            self.sparklines[name].data = list(self.history[name])
        self.plain = "  ".join(parts)
