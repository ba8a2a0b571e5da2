"""Both twins against the golden vectors of routing contract v1 (docs/routing-contract.md)."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.core.golden_tables import (
    assert_golden_lookups,
    assert_golden_shares,
    golden_picks,
    maglev_from,
    ring_from,
)


def test_golden_file_is_what_the_reference_writes(reference: ModuleType) -> None:
    """golden.json was not hand-edited, and the generator was not changed without regenerating."""
    on_disk = (reference.GOLDEN_PATH).read_text(encoding="utf-8")
    assert on_disk == reference.render(), "run tests/core/make_golden.py (contract change only)"


def test_default_vnodes_is_the_contracts(core: ModuleType, golden: dict[str, Any]) -> None:
    assert golden["contract_version"] == 1
    assert golden["default_vnodes"] == core.DEFAULT_VNODES


def test_route_key(core: ModuleType, golden: dict[str, Any]) -> None:
    assert len(golden["keys"]) >= 8
    for vector in golden["keys"]:
        data = bytes.fromhex(vector["data_hex"])
        expected = int(vector["key"])
        assert core.route_key(data) == expected, data
        assert core.route_key(bytearray(data)) == expected
        assert core.route_key(memoryview(data)) == expected


def test_route_key_of_a_non_contiguous_view(core: ModuleType, golden: dict[str, Any]) -> None:
    data = bytes.fromhex(golden["keys"][-2]["data_hex"])  # bytes(range(256))
    strided = memoryview(data)[::2]
    assert core.route_key(strided) == core.route_key(data[::2])


def test_prefix_id_and_route_key(core: ModuleType, golden: dict[str, Any]) -> None:
    for vector in golden["prefixes"]:
        text = vector["text"]
        assert text.encode("utf-8").hex() == vector["utf8_hex"]
        assert core.prefix_id(text) == vector["prefix_id"]
        assert core.prefix_route_key(text) == int(vector["route_key"])
        assert core.route_key(text.encode("utf-8")) == int(vector["route_key"])


@pytest.mark.parametrize("which", [0, 1], ids=["weighted-vnodes4", "five-default"])
def test_ring_points(core: ModuleType, golden: dict[str, Any], which: int) -> None:
    spec = golden["rings"][which]
    ring = ring_from(core, spec)
    points = ring.points()
    assert len(points) == spec["point_count"]
    expected_points = [(int(p), m) for p, m in spec.get("points", spec.get("points_head", []))]
    assert points[: len(expected_points)] == expected_points


@pytest.mark.parametrize(
    ("kind", "which", "build"),
    [
        ("rings", 0, ring_from),
        ("rings", 1, ring_from),
        ("maglevs", 0, maglev_from),
        ("maglevs", 1, maglev_from),
    ],
    ids=["ring-weighted-vnodes4", "ring-five-default", "maglev-weighted-13", "maglev-five-default"],
)
def test_shares_and_lookups(
    core: ModuleType,
    golden: dict[str, Any],
    kind: str,
    which: int,
    build: Callable[[ModuleType, dict[str, Any]], Any],
) -> None:
    """Key-space shares, and owner and preference lookups at the golden keys, on the rings
    and the Maglev tables alike."""
    spec = golden[kind][which]
    table = build(core, spec)
    assert_golden_shares(table, spec)
    assert_golden_lookups(table, spec)


def test_picks(core: ModuleType, golden: dict[str, Any]) -> None:
    rings = {spec["name"]: ring_from(core, spec) for spec in golden["rings"]}
    for case, key, expected, min_cap in golden_picks(core, golden["picks"]):
        ring = rings[case["ring"]]
        for loads in (list(case["loads"]), array("q", case["loads"])):
            got = ring.pick(
                key, loads, replicas=case["replicas"], factor=case["factor"], min_cap=min_cap
            )
            assert got == expected, case["why"]
            if min_cap == 0:  # the default is the original formula
                assert ring.pick(key, loads, case["replicas"], case["factor"]) == expected


def test_the_floor_vectors_show_both_effects(core: ModuleType, golden: dict[str, Any]) -> None:
    """Among the min_cap > 0 vectors, one keeps a request home that would spill without the
    floor, and one has the floor below the computed cap, so the result is unchanged."""
    rings = {spec["name"]: ring_from(core, spec) for spec in golden["rings"]}
    kept_home, unchanged = 0, 0
    for case in golden["picks"]:
        if int(case["min_cap"]) == 0:
            continue
        ring = rings[case["ring"]]
        without = ring.pick(int(case["key"]), case["loads"], case["replicas"], case["factor"])
        if case["branch"] == "home" and without[1] == "spill":
            kept_home += 1
        if without == (case["member"], case["branch"]):
            unchanged += 1
    assert kept_home >= 1 and unchanged >= 1, (kept_home, unchanged)


def test_the_contract_document_shows_the_current_vectors(golden: dict[str, Any]) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "routing-contract.md").read_text()
    values = [v["key"] for v in golden["keys"]]
    values += [v[field] for v in golden["prefixes"] for field in ("prefix_id", "route_key")]
    for ring in golden["rings"]:
        values += list(ring["owned"].values()) + [lookup["key"] for lookup in ring["lookups"]]
        values += [point for point, _ in ring.get("points", ring.get("points_head", []))]
    values += [case["key"] for case in golden["picks"]]
    missing = [value for value in values if f"`{value}`" not in doc]
    assert not missing, "docs/routing-contract.md is out of date with golden.json"
    rows = [_pick_row(case) for case in golden["picks"]]
    missing = [row for row in rows if row not in doc]
    assert not missing, f"the pick table of docs/routing-contract.md lacks {missing}"
    rows = [_pick_among_row(case) for case in golden["picks_among"]]
    rows += [_placement_row(p) for case in golden["placements"] for p in case["prefixes"]]
    missing = [row for row in rows if row not in doc]
    assert not missing, f"the pick_among/place tables of docs/routing-contract.md lack {missing}"
    assert f"DEFAULT_VNODES = {golden['default_vnodes']}" in doc


def _short(url: str) -> str:
    host = url.removeprefix("http://").rsplit(":", 1)[0]
    return host.split(".")[0] if host.startswith("vllm-") else host


def _pick_row(case: dict[str, Any]) -> str:
    """A pick vector as the contract document's table shows it (from loads to branch)."""
    fields = [case["loads"], case["replicas"], case["factor"], case["min_cap"]]
    return "| " + " | ".join(map(str, [*fields, _short(case["member"]), case["branch"]])) + " |"


def _pick_among_row(case: dict[str, Any]) -> str:
    fields = [case["loads"], case["homes"], case["factor"], case["min_cap"]]
    return "| " + " | ".join(map(str, [*fields, _short(case["member"]), case["branch"]])) + " |"


def _placement_row(prefix: dict[str, Any]) -> str:
    homes = ", ".join(_short(url) for url in prefix["homes"])
    return (
        f"| `{prefix['text']}` | `{prefix['key']}` | {prefix['tokens']:,} | "
        f"{prefix['replicas']} | {homes} |"
    )


def test_picks_among_given_homes(core: ModuleType, golden: dict[str, Any]) -> None:
    rings = {spec["name"]: ring_from(core, spec) for spec in golden["rings"]}
    assert {case["branch"] for case in golden["picks_among"]} >= {"home", "spill"}
    for case in golden["picks_among"]:
        ring = rings[case["ring"]]
        key = int(case["key"])
        assert key == core.route_key(case["key_of"].encode())
        for loads in (list(case["loads"]), array("q", case["loads"])):
            got = ring.pick_among(
                key, loads, case["homes"], factor=case["factor"], min_cap=int(case["min_cap"])
            )
            assert got == (case["member"], case["branch"]), case["why"]


def test_placements(core: ModuleType, golden: dict[str, Any]) -> None:
    """prefix_sidecar/routing/placement.py (over either twin's ring) against the reference."""
    from prefix_sidecar.routing.placement import Placed, place

    rings = {spec["name"]: ring_from(core, spec) for spec in golden["rings"]}
    for case in golden["placements"]:
        ring = rings[case["ring"]]
        items = [
            Placed(int(p["key"]), p["tokens"], p["replicas"], p["id"]) for p in case["prefixes"]
        ]
        for p in case["prefixes"]:
            assert core.prefix_id(p["text"]) == p["id"]
            assert core.prefix_route_key(p["text"]) == int(p["key"])
        homes = place(ring, items, case["budget"], case["balance"])
        for p in case["prefixes"]:
            assert [ring.members[i] for i in homes[p["id"]]] == p["homes"], case["why"]
        # Registration order does not matter: the placement sorts its input.
        assert place(ring, list(reversed(items)), case["budget"], case["balance"]) == homes


def test_the_placement_vectors_show_the_budget_binding(
    core: ModuleType, golden: dict[str, Any]
) -> None:
    """The binding case must differ from the plain ring (which overfills a pod), the
    non-binding one must equal it."""
    rings = {spec["name"]: ring_from(core, spec) for spec in golden["rings"]}
    for case in golden["placements"][:2]:
        ring = rings[case["ring"]]
        plain = dict.fromkeys(ring.members, 0)
        for p in case["prefixes"]:
            for member in ring.preference(int(p["key"]), p["replicas"]):
                plain[member] += p["tokens"]
        if case["budget"] >= sum(p["tokens"] * p["replicas"] for p in case["prefixes"]):
            assert case["homed_tokens"] == plain
        else:
            assert max(plain.values()) > case["budget"] >= max(case["homed_tokens"].values())


# --- routing contract section 9: organic routing -------------------------------------------


def test_chain_keys(core: ModuleType, golden: dict[str, Any]) -> None:
    for case in golden["organic"]["chains"]:
        data = bytes.fromhex(case["data_hex"])
        keys = core.chain_keys(data, case["block_bytes"], case["max_blocks"])
        assert keys == [int(k) for k in case["keys"]], case["why"]
        assert core.chain_keys(memoryview(data), case["block_bytes"], 10**30) == core.chain_keys(
            data, case["block_bytes"], 10**30
        )


def test_chain_keys_share_exactly_the_shared_blocks(golden: dict[str, Any]) -> None:
    """The two prompts with one head share the head's blocks, then differ."""
    chains = {case["why"]: case["keys"] for case in golden["organic"]["chains"]}
    one, other = chains["a prompt, 64-B blocks"], chains["same head, other question"]
    assert one[:2] == other[:2] and one[2:] and len(other) == 2
    assert chains["max_blocks 1: the family key"] == one[:1]


def test_session_homes(core: ModuleType, golden: dict[str, Any]) -> None:
    rings = {spec["name"]: ring_from(core, spec) for spec in golden["rings"]}
    for case in golden["organic"]["session_homes"]:
        ring = rings[case["ring"]]
        index = ring.session_home(int(case["family"]), case["homes"], int(case["session"]))
        assert index == case["index"] and ring.members[index] == case["member"], case


def test_the_contract_document_shows_the_organic_vectors(golden: dict[str, Any]) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "routing-contract.md").read_text()
    organic = golden["organic"]
    values = [k for case in organic["chains"] for k in case["keys"]]
    values += [k for case in organic["messages"] for k in case["keys"]]
    values += [case[field] for case in organic["session_homes"] for field in ("family", "session")]
    missing = [value for value in values if f"`{value}`" not in doc]
    assert not missing, "section 9 of docs/routing-contract.md is out of date with golden.json"
    rows = [
        f"| {c['ring'].split(',')[0]} | {c['homes']} | `{c['session_of']}` | "
        f"{_short(c['member'])} |"
        for c in organic["session_homes"]
    ]
    rows += [
        f"| {c['share']} | {c['members']} | {c['spread']} | {c['size']} |"
        for c in organic["home_sizes"]
    ]
    missing = [row for row in rows if row not in doc]
    assert not missing, f"section 9's tables lack {missing}"
