"""One vLLM KV-events message (topic, 8-byte big-endian seq, msgpack `[ts, events, dp_rank]`)
into typed events, after vLLM's `vllm/distributed/kv_events.py`. Both event encodings are
read: a map with a `"type"` key, defaults omitted (vLLM since mid-2026), and a positional
array `[tag, field, ...]` in the struct's field order, trailing defaults omitted (older vLLM).

The bytes are untrusted and msgpack's cost is per object, so a decode is bounded before it
runs: a payload over MAX_PAYLOAD_BYTES, or with over MAX_CONTAINER_BYTES bytes that
could open a list or map (counted at C speed), is refused unread, and the collector is paused
meanwhile. The worst case then decodes in a few ms, under the loop's 10 ms step. Anything
malformed is a DecodeError, never another exception.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import msgpack

MAX_PAYLOAD_BYTES = 128 * 1024
# The costliest payload under both caps decodes in 3.2-4.3 ms of CPU (16 Ki: 6-10 ms).
MAX_CONTAINER_BYTES = 8 * 1024
MAX_TOPIC_BYTES = 256
# msgpack's fixmap, fixarray, array16/32 and map16/32 type bytes.
_CONTAINER_TYPE_BYTES = bytes(range(0x80, 0xA0)) + bytes(range(0xDC, 0xE0))
_UINT64 = (1 << 64) - 1
_LIMITS: dict[str, int] = {
    "max_buffer_size": MAX_PAYLOAD_BYTES,
    "max_array_len": MAX_PAYLOAD_BYTES,  # a token or hash costs >= 1 byte: no tighter cap needed
    "max_map_len": 64,  # an event map has ~13 fields
    "max_str_len": 4096,
    "max_bin_len": 64,  # a sha256 block hash is 32 bytes
    "max_ext_len": 0,
}
# Field order of vLLM's structs (array_like encoding), after the tag.
_STORED_FIELDS: tuple[str, ...] = ("block_hashes", "parent_block_hash", "token_ids")
_STORED_FIELDS += ("block_size", "lora_id", "medium", "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


class DecodeError(ValueError):
    """The message is not a vLLM KV-events message (the subscriber counts these)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block (LoRA name, cache_salt, ...)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

# vLLM's medium for the KV cache a request reuses at once: "GPU", on CPU pods too.
DEVICE_MEDIUM = "GPU"


def on_device(event: KvEvent) -> bool:
    """Whether `event` is about the pod's own KV cache: no medium (vLLM before tiers) or
    DEVICE_MEDIUM. An offloading pod also reports the copies it keeps in another tier
    ("CPU", ...) under the same hashes; its GPU eviction of an offloaded block is a
    BlockRemoved for the GPU only."""
    medium = getattr(event, "medium", None)
    return medium is None or medium.upper() == DEVICE_MEDIUM


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number; vLLM's end-of-replay marker reads as -1."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_message(frames: list[bytes]) -> EventBatch:
    """Three frames into an EventBatch; DecodeError for anything else."""
    if len(frames) != 3:
        raise DecodeError(f"{len(frames)} frames, not 3")
    topic, seq_frame, payload = frames
    if len(topic) > MAX_TOPIC_BYTES:
        raise DecodeError("topic too long")
    return decode_payload(decode_seq(seq_frame), payload)


def decode_payload(seq: int, payload: bytes) -> EventBatch:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise DecodeError(f"payload of {len(payload)} bytes, over {MAX_PAYLOAD_BYTES}")
    if len(payload) - len(payload.translate(None, _CONTAINER_TYPE_BYTES)) > MAX_CONTAINER_BYTES:
        raise DecodeError("payload has too many lists or maps")
    # Thousands of fresh containers would set off collections of the whole heap: the
    # collector waits until msgpack's objects are built, read and freed again.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _batch(seq, _unpack(payload))
    except DecodeError as exc:
        message = str(exc)  # not raised from here: its traceback would keep msgpack's objects
    finally:
        if paused:
            gc.enable()
    raise DecodeError(message)


def _batch(seq: int, body: Any) -> EventBatch:
    if not isinstance(body, list) or not 2 <= len(body) <= 3:
        raise DecodeError("payload is not [ts, events, dp_rank]")
    ts, events = body[0], body[1]
    dp_rank = body[2] if len(body) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise DecodeError("payload is not [ts, events, dp_rank]")
    if dp_rank is not None and not _is_int(dp_rank):
        raise DecodeError("dp_rank is not an int")
    return EventBatch(seq, float(ts), tuple(_event(e) for e in events), dp_rank)


def _unpack(payload: bytes) -> Any:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True, **_LIMITS)
    try:
        unpacker.feed(payload)
        body = unpacker.unpack()
    except Exception as exc:  # msgpack's errors are many (OutOfData, StackError, ValueError, ...)
        raise DecodeError(f"bad msgpack: {type(exc).__name__}") from None
    if unpacker.tell() != len(payload):
        raise DecodeError("trailing bytes after the payload")
    return body


def _event(raw: object) -> KvEvent:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise DecodeError("event is neither a map nor an array")
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=_hashes(fields.get("block_hashes")),
            parent_block_hash=None
            if fields.get("parent_block_hash") is None
            else _hash(fields["parent_block_hash"]),
            token_ids=_ints(fields.get("token_ids"), "token_ids"),
            block_size=_positive(fields.get("block_size")),
            lora_name=_optional_str(fields.get("lora_name"), "lora_name"),
            medium=_optional_str(fields.get("medium"), "medium"),
            extra_keys=_extra_keys(fields.get("extra_keys")),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            _hashes(fields.get("block_hashes")), _optional_str(fields.get("medium"), "medium")
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise DecodeError("unknown event type")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hash(value: object) -> int:
    """A block hash as uint64: an int as sent, or sha256 bytes read as vLLM's int form does
    (big-endian, low 64 bits), so both settings of VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES agree."""
    if _is_int(value) and 0 <= value <= _UINT64:  # type: ignore[operator]
        return value  # type: ignore[return-value]
    if isinstance(value, bytes) and value:
        return int.from_bytes(value, "big") & _UINT64
    raise DecodeError("block hash is not a uint64 or bytes")


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise DecodeError("block_hashes is not an array")
    return tuple(_hash(h) for h in value)


def _ints(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(v) and 0 <= v <= _UINT64 for v in value):
        raise DecodeError(f"{name} is not an array of ints")
    return tuple(value)


def _positive(value: object) -> int:
    if not _is_int(value) or not 0 < value <= 1 << 20:  # type: ignore[operator]
        raise DecodeError("block_size is not a positive int")
    return value  # type: ignore[return-value]


def _optional_str(value: object, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DecodeError(f"{name} is not a string")


def _extra_keys(value: object) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise DecodeError("extra_keys is not an array")
    return tuple(tuple(k) if isinstance(k, list) else k for k in value)
