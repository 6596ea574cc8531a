"""`sluice generate --connect ADDR`: the same request and output as the offline form, served
by a running daemon. Text streams to stdout as it arrives; `--json` prints one object at the
end. The flags are defined by `generate.py`."""

from __future__ import annotations

import argparse
import sys

from sluice.daemon.commands.generate import parse_prompt_ids, print_result


def request_kwargs(args: argparse.Namespace) -> dict:
    """The client's `generate` keywords from the shared flags (prompt form included)."""
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=list(args.stop),
                  ignore_eos=args.ignore_eos)
    if args.chat is not None:
        kwargs["messages"] = [{"role": "user", "content": args.chat}]
    elif args.prompt_ids is not None:
        kwargs["prompt_ids"] = parse_prompt_ids(args.prompt_ids)
    else:
        kwargs["prompt"] = args.prompt
    return kwargs


def run(args: argparse.Namespace) -> int:
    from sluice.ipc.client import Client
    from sluice.ipc.errors import SluiceError

    try:
        kwargs = request_kwargs(args)
        with Client(args.connect) as client:
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
