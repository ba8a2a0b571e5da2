"""Fixtures the upstream tests share with the server tests."""

from tests.server.conftest import closed_port

__all__ = ["closed_port"]
