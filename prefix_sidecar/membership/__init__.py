"""Backend membership: where the pod list comes from (sources), who may serve (health), and
the pool that turns both into the routing table (pool)."""
