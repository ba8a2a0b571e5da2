"""Routing: turn a prefix or prompt into a route key, and a route key into a pod."""
