"""The console's confirmations are read whole before they are answered: the drain question
(the longest) wraps inside its box instead of being cut off, on a wide terminal or a narrow
one."""

from __future__ import annotations

import pytest
from support.console import drive, wait_until
from textual.geometry import Region

from sluice.tui.app import SluiceTop
from sluice.tui.confirm_screen import ConfirmScreen


def _shown(widget) -> str:
    """The text a widget draws, its lines joined."""
    lines = widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return " ".join(" ".join(line.text.split()) for line in lines)


@pytest.mark.parametrize("size", [(200, 50), (80, 24)])
def test_the_drain_confirmation_is_shown_whole(tmp_path, size) -> None:
    async def body():
        # no daemon there: the console shows itself disconnected, its keys still work
        app = SluiceTop(f"ipc://{tmp_path}/nobody.sock")
        async with app.run_test(size=size) as pilot:
            await pilot.press("d")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.pause(0.1)
            question = app.screen.question
            assert question.startswith("Drain the daemon?")
            label = app.screen.query_one("#question")
            # drawn inside its box (what sticks out is cut off), and every word drawn
            assert label.parent.content_region.contains_region(label.region), (
                label.region, label.parent.content_region)
            assert _shown(label).strip() == " ".join(question.split())
            await pilot.press("n")

    drive(body)
