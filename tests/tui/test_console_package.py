"""`tui/` is the console: the `sluice` commands other than `top` (the console's own command)
keep their helpers in `daemon/commands/`, and take from `tui/` only the display helpers the
console shares with them, which import no Textual. Read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_COMMAND = "top.py"
SHARED = {"sluice.tui.limits"}  # one tenant's limits as text: the tenants table and `sluice tenants`


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_commands_other_than_the_console_take_only_shared_helpers_from_tui() -> None:
    taken = {}
    for path in sorted((ROOT / "daemon" / "commands").glob("*.py")):
        if path.name == CONSOLE_COMMAND:
            continue
        from_tui = {name for name in _imports(path) if name.startswith("sluice.tui")}
        if from_tui - SHARED:
            taken[path.name] = sorted(from_tui - SHARED)
    assert taken == {}


def test_the_shared_helpers_import_no_textual() -> None:
    for name in SHARED:
        path = ROOT / "tui" / (name.removeprefix("sluice.tui.") + ".py")
        assert not {i for i in _imports(path) if i.split(".")[0] == "textual"}, path
