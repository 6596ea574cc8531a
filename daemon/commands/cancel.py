"""`sluice cancel ID`: end one request (the daemon-wide id `status`/`top` show); its client
gets `Finished(cancelled)` and its KV is freed at once."""

from __future__ import annotations

import argparse

from sluice.daemon.commands.operator import add_common_arguments, run_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", help="daemon-wide request id")
    add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from sluice.ipc import messages as m

    return run_command(args, m.CancelCommand(args.request_id))
