"""Fixtures that tests in more than one folder share."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.api_key import API_KEY_SOURCES, KeySettings, debug_settings_with_key


@pytest.fixture(params=API_KEY_SOURCES)
def key_settings(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> KeySettings:
    """Each way to give the sidecar its API key, with every log record captured: call it with
    the key for the settings to start a sidecar with."""
    caplog.set_level(logging.DEBUG)
    return lambda secret: debug_settings_with_key(request.param, secret, tmp_path, monkeypatch)
