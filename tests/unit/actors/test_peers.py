"""The gateway's book of forgotten peers: bounded, probed at most once a second."""

from __future__ import annotations

from sluice.actors.front.peers import PROBE_INTERVAL, PeerBook


def test_a_forgotten_peer_is_probed_at_most_once_per_interval() -> None:
    book = PeerBook(capacity=8)
    assert book.forget(b"slow", now=10.0)
    assert not book.forget(b"slow", now=10.5)  # already forgotten: counted once
    assert book.forgotten_peers == 1
    assert not book.probe_due(b"slow", now=10.0 + PROBE_INTERVAL / 2)
    assert book.probe_due(b"slow", now=10.0 + PROBE_INTERVAL)
    assert not book.probe_due(b"slow", now=10.0 + PROBE_INTERVAL * 1.5)
    book.remember(b"slow")
    assert not book.is_forgotten(b"slow")
    assert book.stats().forgotten_peers == 1


def test_the_book_never_holds_more_than_its_capacity() -> None:
    book = PeerBook(capacity=3)
    for i in range(100):
        book.forget(bytes([i]), now=float(i))
    assert len(book) == 3
    assert [book.is_forgotten(bytes([i])) for i in (0, 96, 97, 98, 99)] == [
        False, False, True, True, True]  # the oldest go first
    assert book.forgotten_peers == 100
