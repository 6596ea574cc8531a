"""`sluice recover`: restart the worker (or start a stopped one); interrupted requests are
re-admitted and recomputed once it passes its health check."""

from __future__ import annotations

import argparse

from sluice.daemon.commands.operator import add_common_arguments, run_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from sluice.ipc import messages as m

    return run_command(args, m.RecoverCommand())
