"""KV blocks: a gauge of the pool with the admission watermarks marked, and its history."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from sluice.ipc import messages as m

HISTORY = 120  # snapshots kept for the sparkline (30 s at 4 per second)


def gauge(used: float, high: float, low: float, width: int = 40) -> Text:
    """A bar `width` cells wide: used in colour, `L`/`H` where the watermarks sit."""
    cells = [" "] * width
    filled = min(width, round(used * width))
    for i in range(filled):
        cells[i] = "█"
    for mark, fraction in (("L", low), ("H", high)):
        index = min(width - 1, int(fraction * width))
        cells[index] = mark
    colour = "red" if used >= high else "yellow" if used >= low else "green"
    text = Text("[")
    text.append("".join(cells[:filled]), style=colour)
    text.append("".join(cells[filled:]))
    text.append("]")
    return text


class KVPanel(Vertical):
    DEFAULT_CSS = """
    KVPanel { width: 1fr; height: 7; border: round $secondary; }
    KVPanel Sparkline { height: 2; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "KV cache"
        self.history: deque[float] = deque([0.0], maxlen=HISTORY)
        self.plain = ""

    def compose(self) -> ComposeResult:
        self.gauge = Static(id="kv-gauge")
        self.sparkline = Sparkline([0.0], id="kv-history")
        yield self.gauge
        yield self.sparkline

    def show(self, snapshot: m.ControlSnapshot) -> None:
        kv = snapshot.status.kv
        info = (snapshot.detail or m.ConsoleDetail()).kv
        total = max(kv.total_blocks, 1)
        used = kv.used_blocks / total
        high, low = info.high_watermark, info.low_watermark
        self.history.append(used)
        line = (f"used {kv.used_blocks}/{kv.total_blocks} ({used:.0%})  free {kv.free_blocks}"
                f"  cached {kv.cached_blocks}  L {low:.0%} H {high:.0%}")
        self.plain = line
        text = gauge(used, high, low)
        text.append("\n" + line)
        if not info.admission_open:
            text.append("  admission closed", style="bold red")
        self.gauge.update(text)
        self.sparkline.data = list(self.history)
