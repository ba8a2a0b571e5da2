"""The index's key layout: sampling a long chain, and reading the longest match per pod."""

from __future__ import annotations

from prefix_sidecar.kv_events.block_keys import KEY_BYTES
from prefix_sidecar.kv_index import layout


def test_a_short_chain_is_asked_whole_and_a_long_one_evenly_with_its_last_block() -> None:
    keys = list(range(1000))
    assert layout.sampled(keys[:5]) == [(n + 1, keys[n]) for n in range(5)]
    picks = layout.sampled(keys, limit=10)
    assert [count for count, _ in picks] == [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]
    assert picks[-1] == (1000, keys[-1])


def test_the_scripts_arguments_carry_the_sampled_keys_in_one_string() -> None:
    keys = [int.from_bytes(bytes([n]) * KEY_BYTES, "little") for n in range(3)]
    prefix, hexes, counts, most = layout.lookup_args("ns", keys, 4096)
    assert (prefix, counts, most) == ("ns:b:", "", "4096")  # counts: each key's position
    width = 2 * KEY_BYTES
    assert [prefix + hexes[i : i + width] for i in range(0, 3 * width, width)] == [
        layout.block_name("ns", key) for key in keys
    ]
    long = list(range(1000))
    _, hexes, counts, _ = layout.lookup_args("ns", long, 4096)
    assert counts.split() == [str(count) for count, _ in layout.sampled(long)]
    assert len(hexes) == 2 * KEY_BYTES * layout.MAX_LOOKUP_BLOCKS


def test_a_blocks_name_is_its_keys_little_endian_bytes_in_hex() -> None:
    # Pinned: the index outlives sidecar and indexer versions.
    assert layout.block_name("ns", 0x0102030405060708) == "ns:b:0807060504030201"
    assert layout.block_name("ns", 2**64 - 1) == "ns:b:" + "ff" * KEY_BYTES


def test_a_field_names_its_pod_and_tier() -> None:
    name = layout.field("http://10.0.0.1:8000", "GPU")
    assert name == "http://10.0.0.1:8000@gpu"
    assert layout.pod_of(name) == "http://10.0.0.1:8000"
    assert layout.field("http://p", None).endswith("@gpu")
