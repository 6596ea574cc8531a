"""`?`: what every key of the console does."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = (
    ("d", "drain: stop admitting, running requests finish (asks first)"),
    ("r", "resume admitting after a drain (asks first)"),
    ("n", "reconcile: free orphaned requests and KV blocks, show what was fixed (asks first)"),
    ("w", "recover: restart the worker; interrupted requests recompute (asks first)"),
    ("x", "cancel the request under the cursor (asks first)"),
    ("up/down", "move in the requests table"),
    ("?", "this help"),
    ("q", "quit the console (the daemon keeps running)"),
)


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 90; height: auto; border: thick $primary; padding: 1 2;
                            background: $surface; }
    """
    BINDINGS = [("escape", "dismiss", "close"), ("question_mark", "dismiss", "close"),
                ("q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("sluice top: keys\n\n" + "\n".join(f"{k:>8}  {v}" for k, v in KEYS))
