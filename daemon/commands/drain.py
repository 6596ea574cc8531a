"""`sluice drain [--deadline S]`: stop admitting; running requests finish (or are cancelled
past the deadline). The daemon keeps running; `sluice resume` admits again."""

from __future__ import annotations

import argparse

from sluice.tui.operator import add_common_arguments, run_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds running requests get before they are cancelled")


def run(args: argparse.Namespace) -> int:
    from sluice.ipc import messages as m

    return run_command(args, m.DrainCommand(args.deadline))
