"""Shared workload for the demo and the fleet benchmark: texts, trace, driver, stats."""
