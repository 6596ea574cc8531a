"""The daemon's intake limits: everything a client can make the daemon hold has one.

One frozen table, read from the config's `[limits]` section, handed to every actor that
admits something (gateway, stream, tokenizer, scheduler). Each limit is checked before the
work it guards is done; a peer that can still be answered gets `Rejected(code, field)`
naming the limit. Nothing here enforces anything: it only says how much.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

# file descriptors a connection costs: its own socket, and its Stream actor's inproc inbox
# (libzmq's mailbox/signaler fds behind each socket); three or four, measured
_FDS_PER_CONNECTION = 4


@dataclass(frozen=True)
class Limits:
    # bytes of one client frame; ZeroMQ's MAXMSGSIZE drops a larger frame's peer unread
    max_frame_bytes: int = 4 * 1024 * 1024
    # items of one array in a client frame (a prompt's token ids, chat messages): a longer one
    # is refused as its header is read, before the frame is decoded
    max_frame_items: int = 1 << 20
    # live connections (Streams); None: derived from RLIMIT_NOFILE, `reserved_fds` kept spare
    max_connections: int | None = None
    reserved_fds: int = 256
    # requests one connection may have open, those still tokenizing included
    max_requests_per_connection: int = 256
    # prompt bytes received but not yet tokenized, over the whole daemon
    max_pending_prompt_bytes: int = 64 * 1024 * 1024
    # characters of one prompt (text, or all chat messages' contents together)
    max_prompt_chars: int = 1_000_000
    max_messages: int = 1024  # chat messages in one request
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_logit_bias: int = 300  # entries of one request's logit_bias
    # bytes of one request's grammar (a JSON schema's text, a regex, the choices, a grammar)
    max_grammar_bytes: int = 64 * 1024
    # milliseconds a check of a grammar not seen before may run, from its start (not from the
    # request's arrival): past it the check's process is killed and the request gets a 400
    max_grammar_compile_ms: int = 2000
    # processes checking grammars, for the whole daemon; a sender's checks run one at a time
    # (a tenant its key proves, else the client), so one sender's slow grammars hold one
    # process and the others serve the other senders
    grammar_check_processes: int = 2
    # checks of one sender waiting behind its running one: past it, refused as overloaded
    max_grammar_checks_waiting: int = 16
    max_cached_grammars: int = 256  # grammars' verdicts the fronts remember
    max_n: int = 8  # choices of one request
    max_request_id_chars: int = 128
    max_tenant_chars: int = 64
    # larger grants are clamped to this. Within it a client that reads nothing still gets that
    # many chunks made for each request, work everyone's latency pays for; a reader that falls
    # behind loses nothing (chunks merge while it has no credit), so it is kept small
    max_credits: int = 64
    # client-chosen strings (ids, tenant names) are cut to this many characters in logs
    log_string_chars: int = 64
    # without CURVE, may a client name a tenant that neither the config nor an operator made?
    open_tenants: bool = False
    # queued requests of a tenant that has no max_queued of its own
    default_tenant_max_queued: int = 1024
    # frames the ROUTER buffers for one client before that client is a slow peer
    peer_send_hwm: int = 1024
    # frames the ROUTER queues from one client before it stops reading that client's socket
    peer_recv_hwm: int = 16
    # client frames queued in the whole front at most: live connections and those gone whose
    # frames are still queued count `peer_recv_hwm` each; past it new connections are
    # refused at their handshake. Those frames are held in ZeroMQ's memory, outside
    # Python's, each pinning the read buffer it arrived in (18 KB with its counters): at
    # the default that is 75 MB of small frames at most; the old default, 2^20, was GBs
    max_inbound_frames: int = 1 << 12
    # seconds a client connection may stay open without a stream (no request, or its stream
    # ended): past it the listener closes it; at the connection cap the one idle longest is
    # closed first to make room for a newcomer
    idle_connection_seconds: int = 30

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or value is None:
                continue
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"limits.{name}: must be a non-negative integer, got {value!r}")
        if self.peer_recv_hwm < 1:  # a zero high-water mark is no limit at all to ZeroMQ
            raise ValueError(f"limits.peer_recv_hwm: must be at least 1, got {self.peer_recv_hwm}")
        if self.grammar_check_processes < 1:  # no grammar could ever be checked
            raise ValueError(f"limits.grammar_check_processes: must be at least 1, got "
                             f"{self.grammar_check_processes}")
        if self.max_credits < 1:  # no request could ever be sent a chunk
            raise ValueError(f"limits.max_credits: must be at least 1, got {self.max_credits}")

    def connection_cap(self, fd_share: float = 1.0) -> int:
        """Live connections allowed: the configured cap, or what `fd_share` of the descriptors
        the fd limit leaves past `reserved_fds` has room for (the HTTP front, when it runs,
        has the other half)."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        return max(1, int((soft - self.reserved_fds) * fd_share) // _FDS_PER_CONNECTION)

    def inbound_connections(self) -> int:
        """Connections whose queues may hold frames at once, within `max_inbound_frames`."""
        return max(1, self.max_inbound_frames // self.peer_recv_hwm)


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft `RLIMIT_NOFILE` to the hard limit; (old soft, new soft)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit above what the kernel allows
            return soft, soft
    return soft, hard


def clip(text: str, limits: Limits) -> str:
    """A client-chosen string as it may appear in a log line."""
    n = limits.log_string_chars
    return text if len(text) <= n else text[:n] + "…"
