"""The KV-events decoder against bytes vLLM's own encoder wrote (both encodings), and against
hostile payloads: every one a DecodeError, each decode well under the loop's 10 ms step."""

from __future__ import annotations

import time

import msgpack
import pytest

from prefix_sidecar.kv_events.decode import (
    MAX_CONTAINER_BYTES,
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_message,
    decode_payload,
    decode_seq,
)

# vLLM 0.32's msgspec encoder on KVEventBatch(ts=1.5, [BlockStored(block_hashes=[2**64-1, 7],
# parent None, token_ids 0..3, block_size 2, medium "GPU"), BlockRemoved([2**63+1], "GPU"),
# AllBlocksCleared()], data_parallel_rank=0): the map encoding.
MAP_ENCODED = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf"
    "ffffffffffffffff07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739400010203aa"
    "626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a4"
    "74797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf8000000000000001a66d6564"
    "69756da347505581a474797065b0416c6c426c6f636b73436c656172656400"
)
# The same through structs declared as vLLM declared them before mid-2026 (array_like=True,
# tag=True, fields block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium),
# parent 7: the positional encoding.
POSITIONAL_ENCODED = bytes.fromhex(
    "93cb3ff80000000000009397ab426c6f636b53746f72656492cfffffffffffffffff0707940001020302c0a3"
    "47505593ac426c6f636b52656d6f76656491cf8000000000000001a347505591b0416c6c426c6f636b73436c"
    "656172656400"
)


@pytest.mark.parametrize(("payload", "parent"), [(MAP_ENCODED, None), (POSITIONAL_ENCODED, 7)])
def test_both_encodings_decode_to_the_same_events(payload: bytes, parent: int | None) -> None:
    batch = decode_message([b"kv", (41).to_bytes(8, "big"), payload])
    assert batch.seq == 41 and batch.ts == 1.5 and batch.dp_rank == 0
    assert batch.events == (
        BlockStored((2**64 - 1, 7), parent, (0, 1, 2, 3), 2, None, "GPU"),
        BlockRemoved((2**63 + 1,), "GPU"),
        AllBlocksCleared(),
    )


def test_sha256_bytes_hashes_read_as_vllms_int_form() -> None:
    digest = bytes(range(32))
    event = {"type": "BlockRemoved", "block_hashes": [digest]}
    batch = decode_payload(0, msgpack.packb([0.0, [event]]))
    assert batch.events == (BlockRemoved((int.from_bytes(digest, "big") & (2**64 - 1),)),)


def test_end_of_replay_marker_reads_as_minus_one() -> None:
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1


HOSTILE = {
    "garbage": b"\xc1\xc1\xc1",
    "truncated": MAP_ENCODED[:-5],
    "trailing bytes": MAP_ENCODED + b"\x00",
    "not an array": msgpack.packb({"ts": 1}),
    "events not a list": msgpack.packb([0.0, 5, 0]),
    "unknown type": msgpack.packb([0.0, [{"type": "BlockMoved"}]]),
    "negative hash": msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [-1]}]]),
    "hash a string": msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
    "token a float": msgpack.packb(
        [0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [0.5], "block_size": 1}]]
    ),
    "block_size zero": msgpack.packb(
        [0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 0}]]
    ),
    "deep nesting": b"\x93\x00" + b"\x91" * 100_000 + b"\xc0\x00",
    "int map key": msgpack.packb([0.0, [{1: 2}]]),
    "huge string header": b"\x93\x00\x91\xdb\xff\xff\xff\xff",
    "huge array header": b"\x93\x00\xdd\xff\xff\xff\xff",
    "ext type": b"\x93\x00\x91\xd4\x01\x00\x00",
}


@pytest.mark.parametrize("payload", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_payloads_are_decode_errors(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_payload(0, payload)


@pytest.mark.parametrize(
    "frames", [[b"a", b"b"], [b"kv", b"\x00" * 7, b""], [b"x" * 300, b"\x00" * 8, b""]]
)
def test_bad_frames_are_decode_errors(frames: list[bytes]) -> None:
    with pytest.raises(DecodeError):
        decode_message(frames)


def test_a_100_mb_batch_is_refused_before_unpacking() -> None:
    payload = b"\x93\x00\xdd" + b"\x00" * (100 * 1024 * 1024)
    started = time.thread_time()  # CPU time: the other jobs on this machine do not count
    with pytest.raises(DecodeError, match="over"):
        decode_payload(0, payload)
    assert time.thread_time() - started < 0.001


def test_too_many_lists_or_maps_are_refused_before_unpacking() -> None:
    with pytest.raises(DecodeError, match="too many"):
        decode_payload(0, msgpack.packb([0.0, [[]] * (MAX_CONTAINER_BYTES + 1), 0]))


@pytest.mark.parametrize(("element", "header_bytes"), [([], 1), ({}, 1), ([0], 1), ({"a": []}, 2)])
def test_the_costliest_payload_under_the_caps_decodes_within_the_step(
    element: object, header_bytes: int
) -> None:
    """As many containers as the cap lets through, the rest one-byte strings: the CPU time of
    a decode (thread time, so that the other jobs on this machine do not count)."""
    containers = MAX_CONTAINER_BYTES // header_bytes - 8
    filler = MAX_PAYLOAD_BYTES - 16 - containers * len(msgpack.packb(element))
    payload = msgpack.packb([0.0, [element] * containers + [""] * filler, 0])
    assert len(payload) <= MAX_PAYLOAD_BYTES
    worst = 0.0
    for _ in range(5):
        started = time.thread_time()
        with pytest.raises(DecodeError):
            decode_payload(0, payload)
        worst = max(worst, time.thread_time() - started)
    assert worst < 0.010, f"{worst * 1e3:.1f} ms"
