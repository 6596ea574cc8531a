"""`sluice chat --connect ADDR`: an interactive, streaming chat with a running daemon.

The conversation is kept here and sent whole each turn (the daemon's prefix cache makes the
repeated part cheap). `/reset` forgets it, `/quit` or end of input leaves.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", metavar="ADDR", default="tcp://127.0.0.1:7340")
    parser.add_argument("--system", default=None, help="a system message to start with")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from sluice.ipc.client import Client
    from sluice.ipc.vocabulary import SluiceError

    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    try:
        with Client(args.connect) as client:
            info = client.status()
            if interactive:
                print(f"connected to {info.model} (protocol {info.protocol_version}); "
                      "/reset clears, /quit leaves")
            while True:
                if interactive:
                    sys.stdout.write("> ")
                    sys.stdout.flush()
                line = sys.stdin.readline()
                if not line or line.strip() == "/quit":
                    return 0
                if line.strip() == "/reset":
                    history = history[:1] if args.system else []
                    continue
                if not line.strip():
                    continue
                history.append({"role": "user", "content": line.rstrip("\n")})
                generation = client.generate(messages=history, max_tokens=args.max_tokens,
                                             temperature=args.temperature, top_p=args.top_p,
                                             seed=args.seed)
                try:
                    for chunk in generation:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                except KeyboardInterrupt:
                    generation.cancel()
                    generation.collect()
                sys.stdout.write("\n")
                history.append({"role": "assistant", "content": generation.result.text})
    except SluiceError as exc:
        print(f"sluice chat: {exc}", file=sys.stderr)
        return 2
