"""The `sluice` command: a thin dispatcher to one module per subcommand.

Subcommand modules are imported only when used, so `sluice status` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from sluice.daemon import version
from sluice.daemon.logs import configure_logging

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("sluice.daemon.commands.generate", "generate text, offline or from a daemon"),
    "chat": ("sluice.daemon.commands.chat", "chat interactively with a daemon"),
    "simulate": ("sluice.daemon.commands.simulate", "run a scheduling scenario without a model"),
    "bench": ("sluice.daemon.commands.bench", "load-test a running daemon"),
    "status": ("sluice.daemon.commands.status", "show the daemon's state"),
    "drain": ("sluice.daemon.commands.drain", "stop admitting; running requests finish"),
    "resume": ("sluice.daemon.commands.resume", "admit again after a drain"),
    "reconcile": ("sluice.daemon.commands.reconcile", "find and free orphaned requests and KV"),
    "recover": ("sluice.daemon.commands.recover", "restart the worker and re-admit its requests"),
    "cancel": ("sluice.daemon.commands.cancel", "cancel one request by id"),
    "tenants": ("sluice.daemon.commands.tenants", "list tenants, or change one's weight/limits"),
    "top": ("sluice.daemon.commands.top", "the live console"),
    "usage": ("sluice.daemon.commands.usage", "sum the usage records of a usage log"),
}


SAID = re.compile(r"\(default\b|default:|%\(default\)")  # a help that gives its default


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every option's --help line ends with its default, unless the help already says it or
    the default is to have none; subcommands' options included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                show_defaults(child)
            continue
        help_text = action.help
        default = action.default
        if (not action.option_strings or help_text == argparse.SUPPRESS
                or default is argparse.SUPPRESS or SAID.search(help_text or "")
                or default is None or default is False or default == []):
            continue  # no default worth saying ("none", "off") or said already
        action.help = f"{help_text} (default: %(default)s)" if help_text else "(default: %(default)s)"
    return parser


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {version() or '(not installed)'}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="sluice client and tools")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name != module_name:
                    raise
                continue  # a subcommand not built yet stays listed but inert
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_module=module)
    return show_defaults(parser)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # what a command prints is its answer (text or --json): log lines go to stderr, and only
    # warnings unless asked
    configure_logging(os.environ.get("SLUICE_LOG_LEVEL", "warning"))
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    module = getattr(args, "_module", None)
    if module is None:
        parser.error(f"'{args.command}' is not available in this build")
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
