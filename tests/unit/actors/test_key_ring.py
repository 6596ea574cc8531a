"""API keys are looked up as docs/http-api.md says: against every key, each in constant time, so
the time of a lookup says nothing of which key (or how much of one) matched."""

from __future__ import annotations

import hmac

from sluice.actors.http import front as http
from sluice.actors.http.front import KeyRing


def test_a_lookup_compares_every_key_in_constant_time(monkeypatch) -> None:
    compared = []
    constant_time = hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return constant_time(a, b)

    monkeypatch.setattr(http.hmac, "compare_digest", compare_digest)
    ring = KeyRing({"alice": ["key-a1", "key-a2"], "bob": ["key-b"]})
    for key, tenant in ((b"key-a1", "alice"), (b"key-b", "bob"), (b"key-a", None),
                        (b"", None)):
        compared.clear()
        assert ring.tenant(key) == tenant
        # no early exit on the first match or mismatch: all three keys, every time
        assert sorted(known for known, _ in compared) == [b"key-a1", b"key-a2", b"key-b"]
        assert all(given == key for _, given in compared)
