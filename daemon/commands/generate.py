"""`sluice generate`: one request, from a daemon (the local one at `DEFAULT_CONNECT`, as
`chat` and `bench` use, or `--connect ADDR`; handled by `remote.py`) or in this process
(`--offline`, which says on stderr that it loads the model, and when it is done). Both print
the same text or `--json` object."""

from __future__ import annotations

import argparse
import sys
import time

from sluice.daemon.commands.one_request import (
    DEFAULT_CONNECT, grammar_from_args, parse_prompt_ids, print_result,
)  # fmt: skip

# the names only, kept here so the CLI's --help does not import torch
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--offline", action="store_true",
                       help="load the model in this process instead of asking a daemon")
    where.add_argument("--connect", metavar="ADDR", default=None,
                       help=f"daemon address (default: the local daemon, {DEFAULT_CONNECT})")
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face folder (offline; default: embedded model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="offline only; auto picks bfloat16 where the CPU/GPU has it")
    parser.add_argument("--kv-dtype", default="auto", choices=DTYPE_CHOICES,
                        help="offline only; the KV pool's dtype (auto: as --dtype)")
    parser.add_argument("--deterministic", action="store_true",
                        help="offline only; greedy output independent of batch, chunking and "
                             "prefix cache (CPU; costs compute)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="offline only; split the model across N rank processes (CPU, "
                             "gloo)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw prompt text")
    what.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    what.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json-schema", metavar="FILE", default=None,
                        help="a JSON schema the output follows (its file)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def sampling_from_args(args):
    from sluice.ipc.vocabulary import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
        ignore_eos=args.ignore_eos, **grammar_from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    if not args.offline:
        from sluice.daemon.commands import remote

        return remote.run(args)
    from sluice.actors.engine import Engine
    from sluice.actors.executor.worker import model_label
    from sluice.actors.executor.model_files import ModelLoadError
    from sluice.ipc.vocabulary import RejectedError
    from sluice.ipc.vocabulary import InvalidParams

    try:
        sampling = sampling_from_args(args)
        if args.chat is not None:  # a bad flag is told before the model loads
            prompt = {"messages": [{"role": "user", "content": args.chat}]}
        elif args.prompt_ids is not None:
            prompt = {"prompt_token_ids": parse_prompt_ids(args.prompt_ids)}
        else:
            prompt = {"prompt": args.prompt}
        name, size = model_label(args.model)
        print(f"loading model {name} ({size}) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        engine = Engine(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype,
                        deterministic=args.deterministic, tensor_parallel=args.tensor_parallel)
        print(f"model loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr,
              flush=True)
        try:
            request_id = engine.add_request(sampling=sampling, **prompt)
            text, token_ids, finished = [], [], None
            while finished is None:
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    text.append(out.text)
                    token_ids.extend(out.new_token_ids)
                    if not args.json and out.text:
                        sys.stdout.write(out.text)
                        sys.stdout.flush()
                    if out.finished:
                        finished = out
        finally:
            engine.close()  # a tensor-parallel engine's other ranks
    except (ModelLoadError, RejectedError, InvalidParams, ValueError) as exc:
        print(f"sluice generate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print_result(args, "".join(text), token_ids, finished.finish_reason, finished.usage)
    else:
        sys.stdout.write("\n")
    return 0
