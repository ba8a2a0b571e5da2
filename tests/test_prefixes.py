"""The prefix store (prefix_sidecar/prefixes.py): one text under several names, names bounded like
prefixes (issue 11 item 11)."""

from __future__ import annotations

import pytest

from prefix_sidecar.prefixes import PrefixLimitExceeded, PrefixStore

# --- PrefixStore: one text, several names ---------------------------------------------------


def test_a_text_under_two_names_belongs_to_both_and_hands_over_its_name() -> None:
    store = PrefixStore()
    a, _ = store.register("a", "shared text")
    b, created = store.register("b", "shared text")
    assert b is a and not created
    assert (a.names, a.name) == (("a", "b"), "a")
    assert [(name, entry.id) for name, entry in store.named()] == [("a", a.id), ("b", a.id)]

    assert store.unregister_name("a") == []  # "b" still holds the text
    assert (a.names, a.name) == (("b",), "b")
    assert store.by_name("b") is a and not store.has_name("a")
    assert [(name, entry.id) for name, entry in store.named()] == [("b", a.id)]

    assert store.unregister_name("b") == [a.id]
    assert len(store) == 0 and store.named() == []


def test_unregistering_a_shared_id_removes_it_from_every_name() -> None:
    store = PrefixStore()
    old, _ = store.register("rules", "v1")
    store.register("alias", "v1")
    new, _ = store.register("rules", "v2")
    assert store.unregister_id(old.id) == [old.id]
    assert store.versions("rules") == [new.id]
    assert not store.has_name("alias")  # its only version is gone
    assert old.names == ()


def test_names_are_bounded_like_prefixes() -> None:
    store = PrefixStore(max_prefixes=3)
    for name in ("a", "b", "c"):
        store.register(name, "one text")
    with pytest.raises(PrefixLimitExceeded, match=r"3 prefix names.*max_prefixes"):
        store.register("d", "one text")
    store.register("c", "one text")  # a known name is not a new one
    store.unregister_name("a")
    store.register("d", "one text")
