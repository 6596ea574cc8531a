"""`sluiced worker --join ADDR --rank R`: one rank of a daemon's tensor-parallel group, run
on another host (or as its own process on the same one).

It joins the daemon's worker at ADDR over CURVE (`[worker] join_listen`; the daemon's public
key, this rank's own secret key from a file), loads its shard of the model (`--model`, the
same model the daemon serves, from this host's disk), serves the group's steps, and joins
again when the group ends (the daemon's worker restarted). torchrun's variables stand in
for the flags: `MASTER_ADDR` and `MASTER_PORT` for `--join`, `RANK` for `--rank`, and
`WORLD_SIZE` is checked against the group's size. A refused key, address or model exits
77; see docs/scaling.md.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> None:
    worker = sub.add_parser("worker", help="run one rank of a daemon's tensor-parallel group")
    worker.add_argument("--join", metavar="tcp://HOST:PORT", default=None,
                        help="the daemon's [worker] join_listen (default: tcp://$MASTER_ADDR:"
                             "$MASTER_PORT)")
    worker.add_argument("--rank", type=int, default=None, help="this rank (default: $RANK)")
    worker.add_argument("--model", default=None,
                        help="the daemon's model, on this host (default: the embedded model)")
    worker.add_argument("--server-key", default=None, metavar="Z85",
                        help="the daemon worker's CURVE public key")
    worker.add_argument("--server-key-file", default=None, metavar="FILE",
                        help="a file holding --server-key instead")
    worker.add_argument("--secret-key-file", required=True, metavar="FILE",
                        help="this rank's CURVE secret key (its public key must be listed in "
                             "the daemon's [worker] join_public_keys)")
    worker.add_argument("--threads", type=int, default=None, help="torch threads")
    worker.add_argument("--cpus", default=None, metavar="N,N,...", help="pin to these CPUs")
    worker.add_argument("--once", action="store_true",
                        help="exit when the first group ends instead of joining again")
    worker.add_argument("--log-level", default=os.environ.get("SLUICE_LOG_LEVEL", "info"))


def run(args: argparse.Namespace) -> int:
    import signal

    import structlog

    for signum in (signal.SIGINT, signal.SIGTERM):  # a rank just stops: its group fails
        signal.signal(signum, signal.SIG_DFL)

    from sluice.actors.executor.rank_join import (
        EX_NOPERM, JoinRefused, keypair_from_secret, read_key_file,
    )  # fmt: skip
    from sluice.actors.executor.remote_rank import serve_joined_rank

    def fail(message: str, code: int = 2) -> int:
        print(f"sluiced worker: {message}", file=sys.stderr)
        return code

    address = args.join
    if address is None:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return fail("--join: give the daemon's join address, or set MASTER_ADDR and "
                        "MASTER_PORT")
        address = f"tcp://{host}:{port}"
    if not address.startswith("tcp://"):
        return fail(f"--join: a tcp://HOST:PORT address, not {address!r}")
    rank = args.rank
    if rank is None:
        if not os.environ.get("RANK", "").isdigit():
            return fail("--rank: give this rank's number, or set RANK")
        rank = int(os.environ["RANK"])
    if rank < 1:
        return fail(f"--rank: rank 0 is the daemon's worker; a joining rank is 1 or more, "
                    f"not {rank}")
    world = os.environ.get("WORLD_SIZE")
    try:
        server_key = args.server_key or (read_key_file(args.server_key_file, secret=False)
                                         if args.server_key_file else None)
        if server_key is None or len(server_key) != 40:
            return fail("--server-key: the daemon worker's Z85 public key (40 characters), "
                        "or --server-key-file")
        keypair = keypair_from_secret(read_key_file(args.secret_key_file))
    except (OSError, JoinRefused) as exc:
        return fail(str(exc))
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    log = structlog.get_logger("sluice.rank")
    code = serve_joined_rank(address, rank, model=args.model, server_key=server_key,
                             keypair=keypair, threads=args.threads, cpus=cpus,
                             world_size=int(world) if world and world.isdigit() else None,
                             once=args.once, log=log.info)
    if code == EX_NOPERM:
        print(f"sluiced worker: refused by {address} (see the log line above)", file=sys.stderr)
    return code
