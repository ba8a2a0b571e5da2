"""Where a test's sidecar finds its pod API key: one setup for the tests that prove the key
reaches the pods and never the logs, whichever way it was given (environment or file)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

API_KEY_SOURCES = ["env", "file"]
KeySettings = Callable[[str], dict[str, object]]


def debug_settings_with_key(
    source: str, secret: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, object]:
    """Settings that log at debug level and take `secret` as the API key from `source`:
    PREFIX_SIDECAR_API_KEY ("env"), or a key file with a trailing newline ("file", the
    variable unset so the file is the only way in)."""
    settings: dict[str, object] = {"log_level": "debug"}
    if source == "env":
        monkeypatch.setenv("PREFIX_SIDECAR_API_KEY", secret)
    else:
        monkeypatch.delenv("PREFIX_SIDECAR_API_KEY", raising=False)
        key_file = tmp_path / "api-key"
        key_file.write_text(secret + "\n", encoding="utf-8")
        settings["api_key_file"] = str(key_file)
    return settings
