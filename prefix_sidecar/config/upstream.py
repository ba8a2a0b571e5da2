"""How the sidecar talks to the pods, and how big a caller's request may be: the model, the
size limits, the timeouts, the connection budget and the pods' API key."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prefix_sidecar.config.checks import existing_file
from prefix_sidecar.fields import above, at_least, setting

# The env var holding the pods' API key (a Kubernetes Secret maps to any env name, so the
# name needs no setting); api_key_file, when set, wins.
API_KEY_ENV = "PREFIX_SIDECAR_API_KEY"


@dataclass(frozen=True)
class UpstreamSettings:
    """The pods' side of a request, and a caller's limits."""

    model: str = setting("", "model sent to the pods when a request names none")
    max_prefix_bytes: int = setting(
        4 * 1024 * 1024, "largest prefix text a caller may register", check=at_least(1)
    )
    max_input_bytes: int = setting(
        1024 * 1024, "largest thin query or prompt of a request", check=at_least(1)
    )
    max_prefixes: int = setting(1024, "most prefixes registered at once", check=at_least(1))
    max_message_bytes: int = setting(
        8 * 1024 * 1024, "largest gRPC message in either direction", check=at_least(1)
    )

    upstream_timeout_s: float = setting(
        600.0, "seconds a whole completion may take", check=above(0)
    )
    first_token_timeout_s: float = setting(
        60.0, "seconds until a pod's first token, else the next pod", check=above(0)
    )
    connect_timeout_s: float = setting(2.0, "seconds to connect to a pod", check=above(0))
    per_backend_connections: int = setting(
        512, "HTTP connections to one pod at most", check=at_least(1)
    )
    api_key_file: str = setting(
        "", f"file holding the pods' API key; wins over env {API_KEY_ENV}", check=existing_file
    )

    def api_key(self) -> str:
        """The upstream API key, from the file if set, else from the env var; never logged."""
        if self.api_key_file:
            return Path(self.api_key_file).read_text(encoding="utf-8").strip()
        return os.environ.get(API_KEY_ENV, "").strip()
