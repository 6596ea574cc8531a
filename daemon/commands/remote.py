"""`sluice generate [--connect ADDR]`: the same request and output as the offline form, served
by a running daemon (by default the local one). Text streams to stdout as it arrives; `--json`
prints one object at the end. The flags are defined by `generate.py`.

Where nothing listens at the address (a refused TCP connection, a missing ipc:// socket
file), it says so at once, naming the address, instead of waiting for an answer that cannot
come; ZeroMQ itself would only retry quietly."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from sluice.daemon.commands.one_request import (
    DEFAULT_CONNECT, grammar_from_args, parse_prompt_ids, print_result,
)  # fmt: skip

PROBE_SECONDS = 2.0


def request_kwargs(args: argparse.Namespace) -> dict:
    """The client's `generate` keywords from the shared flags (prompt form included)."""
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=list(args.stop),
                  ignore_eos=args.ignore_eos)
    grammar = grammar_from_args(args)
    if grammar:
        kwargs["json_schema"] = grammar["grammar"]
    if args.chat is not None:
        kwargs["messages"] = [{"role": "user", "content": args.chat}]
    elif args.prompt_ids is not None:
        kwargs["prompt_ids"] = parse_prompt_ids(args.prompt_ids)
    else:
        kwargs["prompt"] = args.prompt
    return kwargs


def nothing_listens(address: str) -> str | None:
    """Why no daemon can be listening at `address`, or None where one may be."""
    if address.startswith("ipc://"):
        path = address.removeprefix("ipc://")
        return None if os.path.exists(path) else f"no socket file {path}"
    if not address.startswith("tcp://"):
        return None
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS):
            return None
    except ValueError:
        return None  # the client names a malformed address better
    except ConnectionRefusedError:
        return "connection refused"
    except OSError:
        return None  # unreachable for now, or slow: the client waits and says so


def run(args: argparse.Namespace) -> int:
    from sluice.ipc.client import Client
    from sluice.ipc.vocabulary import SluiceError

    address = args.connect or DEFAULT_CONNECT
    if (why := nothing_listens(address)) is not None:
        print(f"sluice generate: no daemon at {address} ({why}); start one with "
              "`sluiced serve`, or run the model in this process with --offline",
              file=sys.stderr)
        return 2
    try:
        kwargs = request_kwargs(args)
        with Client(address) as client:
            generation = client.generate(**kwargs)
            for chunk in generation:
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            result = generation.result
    except (SluiceError, ValueError) as exc:
        print(f"sluice generate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        usage = {"prompt_tokens": result.usage.prompt_tokens,
                 "completion_tokens": result.usage.completion_tokens}
        print_result(args, result.text, result.token_ids, result.finish_reason, usage)
    else:
        sys.stdout.write("\n")
    if result.finish_reason == "error":
        print(f"sluice generate: {result.error or 'the request failed'}", file=sys.stderr)
        return 1
    return 0
