"""`sluice top`: the live Textual console (queues, KV, latencies, tenants, requests) with
drain, resume, reconcile, recover and cancel behind confirmations; `?` lists the keys."""

from __future__ import annotations

import argparse

from sluice.daemon.commands.operator import add_common_arguments, control_address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, data=False)


def run(args: argparse.Namespace) -> int:
    from sluice.tui.app import SluiceTop

    SluiceTop(control_address(args)).run()
    return 0
