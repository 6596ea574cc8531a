"""The join desk of a tensor-parallel worker (real ZeroMQ sockets with CURVE, no model): a
rank gets in only with a listed key, from its rank's address, claiming a rank the group takes
from another host, with the same model; each refusal says which."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from sluice.actors.executor.rank_join import JoinDesk, JoinRefused, JoinSettings
from sluice.actors.executor.remote_rank import _client, _join

WELCOME = {"world_size": 3, "store_port": 1234}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def desk():
    """A desk for a group of 3 whose ranks 1 and 2 join from 127.0.0.1, and its keys."""
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    rank_keys = [tuple(k.decode() for k in zmq.curve_keypair()) for _ in range(2)]
    context = zmq.Context()
    settings = JoinSettings(f"tcp://127.0.0.1:{free_port()}", ("127.0.0.1", "127.0.0.1"),
                            server_secret, tuple(public for public, _ in rank_keys))
    made = JoinDesk(context, settings, world_size=3)
    yield made, server_public, rank_keys, context
    made.close()
    context.term()


def ask(context, desk_, server_public, keypair, rank: int, fingerprint: str = "fp"):
    """One joining rank's answer: the welcome, or the JoinRefused it raised."""
    client = _client(context, server_public, keypair)
    monitor = client.get_monitor_socket()
    client.connect(desk_.settings.listen)
    try:
        return _join(client, monitor, rank, fingerprint, retry_s=0.2)
    except JoinRefused as exc:
        return exc
    finally:
        client.disable_monitor()
        monitor.close(linger=0)
        client.close(linger=0)


def test_listed_keys_join_and_everyone_else_is_refused_by_name(desk) -> None:
    desk_, server_public, rank_keys, context = desk
    answers: dict[str, object] = {}

    def joiners() -> None:
        answers["wrong rank"] = ask(context, desk_, server_public, rank_keys[0], 5)
        answers["other model"] = ask(context, desk_, server_public, rank_keys[0], 1, "other")
        stranger = tuple(k.decode() for k in zmq.curve_keypair())
        answers["stranger"] = ask(context, desk_, server_public, stranger, 1)
        answers["rank 1"] = ask(context, desk_, server_public, rank_keys[0], 1)
        answers["rank 2"] = ask(context, desk_, server_public, rank_keys[1], 2)

    thread = threading.Thread(target=joiners)
    thread.start()
    joined = desk_.admit(WELCOME, "fp", time.monotonic() + 60)
    thread.join(timeout=60)
    assert sorted(joined) == [1, 2]
    assert answers["rank 1"] == {**WELCOME, "rank": 1}
    assert answers["rank 2"] == {**WELCOME, "rank": 2}
    assert "rank 5 is not one this group takes from another host" in str(answers["wrong rank"])
    assert "a different model" in str(answers["other model"])
    assert "refused this rank's key or address" in str(answers["stranger"])


def test_ranks_that_do_not_come_are_named_at_the_deadline(desk) -> None:
    desk_ = desk[0]
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1, 2 did not join"):
        desk_.admit(WELCOME, "fp", time.monotonic() + 0.5)


def test_a_listed_key_from_another_rank_s_address_is_refused() -> None:
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    keypair = tuple(k.decode() for k in zmq.curve_keypair())
    context = zmq.Context()
    settings = JoinSettings(f"tcp://127.0.0.1:{free_port()}", ("127.0.0.1", "10.9.9.9"),
                            server_secret, (keypair[0],))
    desk_ = JoinDesk(context, settings, world_size=3)
    answers = {}
    thread = threading.Thread(target=lambda: answers.update(
        rank2=ask(context, desk_, server_public, keypair, 2)))
    thread.start()
    try:
        with pytest.raises(TimeoutError):
            desk_.admit(WELCOME, "fp", time.monotonic() + 3)
        thread.join(timeout=30)
        assert "rank 2 joins from 10.9.9.9, not 127.0.0.1" in str(answers["rank2"])
    finally:
        desk_.close()
        context.term()
