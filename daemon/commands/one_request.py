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


def grammar_from_args(args) -> dict:
    """SamplingParams' grammar fields from --json-schema FILE (none without it)."""
    if getattr(args, "json_schema", None) is None:
        return {}
    from sluice.ipc.vocabulary import grammar_of

    try:
        with open(args.json_schema, encoding="utf-8") as file:
            text = file.read()
    except OSError as exc:
        raise ValueError(f"--json-schema: {exc.strerror}: {args.json_schema}") from None
    from sluice.actors.executor.grammar import GrammarError, check

    kind, grammar = grammar_of(json_schema=text)
    try:  # told here, before a model loads or a daemon is asked
        check(kind, grammar)
    except GrammarError as exc:
        raise ValueError(f"--json-schema: {exc}") from None
    return {"grammar_kind": kind, "grammar": grammar}
