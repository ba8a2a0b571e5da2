"""The routing policies' names: a leaf, so that config can check a name without importing the
policies (which import the routing table, and through it the core)."""

from __future__ import annotations

PREFIX_AFFINITY = "prefix_affinity"
POLICIES = (PREFIX_AFFINITY, "consistent_hash", "round_robin", "random", "least_loaded")
