"""Signature checks keep each signer's decoded public key (hearth/trust/keys.py): a kept key judges exactly as a
freshly decoded one, a malformed key is refused every time and never kept, and no stream of keys grows what is kept
past verify_keys_kept."""

from __future__ import annotations

import pytest

from hearth.trust import keys
from hearth.trust.keys import MemberKey, check_public_key, sealed_to, verify, verify_b64

DATA = b'{"type":"shard.heartbeat","node_id":"attic"}'


@pytest.fixture
def nothing_kept():
    keys._verify_key.cache_clear()
    yield
    keys._verify_key.cache_clear()


def test_a_kept_key_still_refuses_a_forged_signature_and_another_key_s(nothing_kept):
    signer, other = MemberKey.generate(), MemberKey.generate()
    signature = signer.sign(DATA)
    assert verify_b64(signer.public_key, DATA, signer.sign_b64(DATA))
    assert verify(other.public_key, DATA, other.sign(DATA))
    hits = keys._verify_key.cache_info().hits

    forged = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify(signer.public_key, DATA, forged)
    assert not verify(signer.public_key, DATA + b" ", signature)
    assert not verify(signer.public_key, DATA, other.sign(DATA))  # the other member's signature of the same bytes
    assert not verify(other.public_key, DATA, signature)  # the signer's signature under the other key
    assert not verify_b64(signer.public_key, DATA, "not base64!")
    assert verify(signer.public_key, DATA, signature)
    assert keys._verify_key.cache_info().hits - hits == 5  # each judged by the key kept, not decoded again


A_MEMBER_S_KEY = MemberKey.generate().public_key


@pytest.mark.parametrize("malformed", [
    "",
    "U" + "A" * 55,  # the right shape, a wrong checksum
    A_MEMBER_S_KEY[:-1],
    "N" + A_MEMBER_S_KEY[1:],  # another kind of nkey
    "U" + "a" * 55,  # not base32
], ids=["empty", "bad checksum", "short", "not a user key", "not base32"])
def test_a_malformed_key_is_refused_every_time_the_same_way_and_never_kept(nothing_kept, malformed):
    signer = MemberKey.generate()
    for _ in range(2):
        assert not verify(malformed, DATA, signer.sign(DATA))
        with pytest.raises(ValueError, match="^not a NATS user public key"):
            check_public_key(malformed)
        with pytest.raises(ValueError, match="^not a NATS user public key"):
            sealed_to(malformed, b"hop keys")
    assert keys._verify_key.cache_info().currsize == 0


def test_no_stream_of_distinct_keys_keeps_more_than_the_bound(nothing_kept):
    first, *strangers = (MemberKey.generate() for _ in range(keys.verify_keys_kept + 20))
    assert verify(first.public_key, DATA, first.sign(DATA))
    for stranger in strangers:
        assert not verify(stranger.public_key, DATA, first.sign(DATA))
    assert keys._verify_key.cache_info().currsize == keys.verify_keys_kept

    # The first key was pushed out by the strangers' and is decoded again, judging as before.
    assert verify(first.public_key, DATA, first.sign(DATA))
    assert not verify(first.public_key, DATA, strangers[0].sign(DATA))
    assert keys._verify_key.cache_info().currsize == keys.verify_keys_kept
