"""What every operator subcommand shares: the flags, sending one command, printing the reply.

`sluice drain|resume|reconcile|recover|cancel|tenants|top` are thin modules over these
helpers; the console (`sluice top`) sends the same control-socket messages itself. Imports
only `sluice.ipc`, so these commands start without the daemon's modules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from sluice.ipc import messages as m

EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE = 0, 1, 2


def default_control_address() -> str:
    """The daemon's default control socket (the same rule as the daemon's runtime dir)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "sluice" if base else Path(tempfile.gettempdir()) / f"sluice-{os.getuid()}"
    return f"ipc://{path / 'control.sock'}"


def add_common_arguments(parser: argparse.ArgumentParser, *, data: bool = True) -> None:
    parser.add_argument("--connect-control", metavar="ADDR", default=None,
                        help="control address (default: the runtime directory's socket)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer")
    if data:
        parser.add_argument("--json", action="store_true", help="print one JSON object")


def control_address(args: argparse.Namespace) -> str:
    return args.connect_control or default_control_address()


def run_command(args: argparse.Namespace, command: object) -> int:
    """Send `command`, print the reply (text or `--json`); exit 0 done, 1 refused, 2 no daemon."""
    from sluice.ipc.codec import to_plain
    from sluice.ipc.control import send_command_sync
    from sluice.ipc.vocabulary import SluiceError

    name = type(command).__name__
    try:
        reply = send_command_sync(control_address(args), command, timeout=args.timeout)
    except SluiceError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if not isinstance(reply, m.CommandReply):
        print(f"sluice: unexpected answer to {name}: {type(reply).__name__}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if getattr(args, "json", False):
        print(json.dumps(to_plain(reply)))
    else:
        print(reply.message, file=sys.stdout if reply.ok else sys.stderr)
        for finding in reply.findings:
            print(f"  - {finding}")
    return EXIT_OK if reply.ok else EXIT_REFUSED
