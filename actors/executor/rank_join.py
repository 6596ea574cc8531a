"""Ranks of a tensor-parallel group that run on other hosts, and how they get in.

Rank 0 (the daemon's worker) opens a *join desk*: a ZeroMQ ROUTER socket on a TCP address,
with CURVE. Only a client whose public key is listed, connecting from the host the config
names for a rank, gets past the handshake (ZAP: the address and the key are both checked);
anyone else is refused before a byte of the protocol is read. A rank that got in says
`join` with its rank and its model's fingerprint; rank 0 answers `welcome` with what the
group agreed (the rendezvous port of its `torch.distributed` store, dtypes, pool size), or
`refused` with the reason. From then on the same socket carries the step plans to that rank,
encrypted and authenticated, exactly as the local ranks get them over their own socket.

The joining side (`sluiced worker --join ADDR --rank R`) is `remote_rank.py`.

What CURVE does not cover: the group's collectives (gloo's TCP traffic between the ranks)
are neither encrypted nor authenticated. Run ranks on other hosts on a private network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq

from sluice.actors.executor.config import ModelConfig

JOIN, WELCOME, REFUSED = b"join", b"welcome", b"refused"
READY, PLAN, RESET, STOP = b"ready", b"plan", b"reset", b"stop"
EX_NOPERM = 77  # `sluiced worker`'s exit status when the daemon refuses its key or address


class JoinRefused(Exception):
    """The daemon would not take this rank: its key or address, or what it said."""


@dataclass(frozen=True)
class JoinSettings:
    """Rank 0's side: where ranks from other hosts join, and who may.

    `hosts[i]` is the IP address rank `world_size - len(hosts) + i` joins from (the group's
    last ranks are the remote ones); `public_keys` are the CURVE keys (Z85) allowed to join;
    `secret_key` is rank 0's own (Z85)."""

    listen: str
    hosts: tuple[str, ...]
    secret_key: str
    public_keys: tuple[str, ...]


def model_fingerprint(config: ModelConfig) -> str:
    """A short digest of a model's shape and options: two ranks must load the same model."""
    return hashlib.sha256(repr(dataclasses.asdict(config)).encode()).hexdigest()[:16]


class _Keys:
    """ZAP's CURVE callback: the listed client keys, nothing else."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = {k.encode() if isinstance(k, str) else k for k in keys}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class JoinDesk:
    """Rank 0's CURVE socket for the ranks on other hosts: admission, then their plans."""

    def __init__(self, context: zmq.Context, settings: JoinSettings, world_size: int):
        from zmq.auth.thread import ThreadAuthenticator

        self.settings = settings
        self.first_remote = world_size - len(settings.hosts)
        self.auth = ThreadAuthenticator(context)
        self.auth.start()
        self.auth.allow(*settings.hosts)
        self.auth.configure_curve_callback("*", _Keys(settings.public_keys))
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.curve_secretkey = settings.secret_key.encode()
        self.socket.curve_publickey = zmq.curve_public(settings.secret_key.encode())
        self.socket.curve_server = True
        self.socket.bind(settings.listen)
        self.identities: dict[int, bytes] = {}  # rank -> its connection on the ROUTER

    def admit(self, welcome: dict, fingerprint: str, deadline: float,
              log: Callable[..., None] | None = None) -> dict[int, bytes]:
        """Wait until every remote rank has joined (by `deadline`, a monotonic time), each
        from its host, with this model; answer each `welcome` (plus its rank)."""
        expected = set(range(self.first_remote, self.first_remote + len(self.settings.hosts)))
        while expected - set(self.identities):
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(min(left, 1.0) * 1000)):
                if left <= 0:
                    missing = sorted(expected - set(self.identities))
                    raise TimeoutError(
                        f"tensor_parallel: rank(s) {', '.join(map(str, missing))} did not join "
                        f"at {self.settings.listen} in time")
                continue
            frames = self.socket.recv_multipart(copy=False)
            identity = frames[0].bytes
            words = [f.bytes for f in frames[1:]]
            peer = frames[-1].get("Peer-Address")
            reason = self._refusal(words, peer, fingerprint, expected)
            if reason:
                if log:
                    log("rank join refused", peer=peer, reason=reason)
                self.socket.send_multipart([identity, REFUSED, reason.encode()])
                continue
            rank = int(words[1])
            self.identities[rank] = identity
            self.socket.send_multipart([identity, WELCOME,
                                        msgpack.packb({**welcome, "rank": rank})])
            if log:
                log("rank joined", rank=rank, peer=peer)
        return dict(self.identities)

    def _refusal(self, words: list[bytes], peer: str, fingerprint: str,
                 expected: set[int]) -> str:
        if len(words) != 3 or words[0] != JOIN or not words[1].isdigit():
            return "expected join RANK FINGERPRINT"
        rank = int(words[1])
        if rank not in expected:
            return (f"rank {rank} is not one this group takes from another host (it takes "
                    f"{', '.join(map(str, sorted(expected)))})")
        if rank in self.identities:
            return f"rank {rank} has joined already"
        host = self.settings.hosts[rank - self.first_remote]
        if peer != host:
            return f"rank {rank} joins from {host}, not {peer}"
        if words[2].decode(errors="replace") != fingerprint:
            return "a different model: every rank must load the same one"
        return ""

    def close(self) -> None:
        self.socket.close(linger=0)
        self.auth.stop()


class GroupGone(Exception):
    """Rank 0's connection closed while this rank waited for a plan."""


def keypair_from_secret(secret: str) -> tuple[str, str]:
    """(public, secret) Z85 keys from a Z85 secret key."""
    return zmq.curve_public(secret.encode()).decode(), secret


def read_key_file(path: str, *, secret: bool = True) -> str:
    """A Z85 key from a file, refusing a secret one others can read (errors never show the
    key); a public key may be anyone's to read."""
    if secret and os.stat(path).st_mode & 0o007:
        raise JoinRefused(f"{path} is readable by others; make it 0600 or 0640")
    with open(path) as handle:
        key = handle.read().strip()
    if len(key) != 40:
        raise JoinRefused(f"{path} does not hold a Z85 CURVE key (40 characters)")
    return key


__all__ = ["EX_NOPERM", "GroupGone", "JoinDesk", "JoinRefused", "JoinSettings",
           "keypair_from_secret", "model_fingerprint", "read_key_file"]
