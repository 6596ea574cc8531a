"""What `sluice generate` reads and prints, whichever side answers it: the local daemon,
another one (`remote.py`) or this process (`--offline`)."""

from __future__ import annotations

import json

DEFAULT_CONNECT = "tcp://127.0.0.1:7340"  # where `sluiced serve` listens by default


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids: not a comma-separated list of integers: {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids: empty")
    return ids


def print_result(args, text: str, token_ids: list[int], finish_reason: str, usage: dict) -> None:
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": token_ids,
            "finish_reason": finish_reason,
            "usage": {"prompt_tokens": usage["prompt_tokens"],
                      "completion_tokens": usage["completion_tokens"]},
        }))
    else:
        print(text)
