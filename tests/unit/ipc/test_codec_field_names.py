"""Every refused frame names a field, even when the offending key is an odd one."""

from __future__ import annotations

import msgpack
import pytest

from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError

client_codec = Codec(m.CLIENT_MESSAGES)


@pytest.mark.parametrize(("body", "field"), [
    ({"request_id": "a", "": 1}, "''"),  # what hypothesis found: an empty key named nothing
    ({"request_id": "a", "sampling": {"": 1}}, "sampling.''"),
    ({"request_id": "a", "bogus": 1}, "bogus"),
    ({"request_id": "a", b"raw": 1}, "b'raw'"),
])
def test_an_unknown_field_is_named_in_field(body: dict, field: str) -> None:
    frame = msgpack.packb([m.PROTOCOL_MAJOR, 0, m.Generate.TAG, body], use_bin_type=True)
    with pytest.raises(CodecError) as refused:
        client_codec.decode(frame)
    assert refused.value.field == field
    assert refused.value.request_id == "a"  # the reply can still name the request
    assert refused.value.message.startswith("unknown field for")
