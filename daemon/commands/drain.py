"""`sluice drain [--deadline S]`: stop admitting; running requests finish (or are cancelled
past the deadline). The daemon keeps running; `sluice resume` admits again."""

from __future__ import annotations

import argparse
import sys

from sluice.daemon.commands.operator import add_common_arguments, run_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds running requests get before they are cancelled")


def run(args: argparse.Namespace) -> int:
    from sluice.actors.control import invalid_field
    from sluice.ipc import messages as m

    command = m.DrainCommand(args.deadline)
    if problem := invalid_field(command):
        print(f"sluice drain: --deadline {problem[1]}", file=sys.stderr)
        return 2
    return run_command(args, command)
