"""The token usage of an answer relayed as bytes, for the same token and cost metrics as
the gRPC path.

vLLM writes `usage` last: at the end of a whole JSON answer, and in the last event before
[DONE] of a stream that asked for it (`stream_options.include_usage`). So only the answer's
last bytes are kept (bounded, amortized O(bytes relayed)), and the last `"usage":` in them
is decoded once, when the answer has ended. Inside a JSON string a quote is escaped, so
generated text cannot fake the key.
"""

from __future__ import annotations

import json

from prefix_sidecar.upstream.sse import usage_counts

TAIL_BYTES = 16 * 1024
_KEY = b'"usage":'
_DECODER = json.JSONDecoder()


class UsageTail:
    def __init__(self) -> None:
        self._tail = bytearray()

    def feed(self, data: bytes) -> None:
        self._tail += data[-TAIL_BYTES:]
        if len(self._tail) > 2 * TAIL_BYTES:  # trimmed in batches: amortized O(n)
            del self._tail[:-TAIL_BYTES]

    def counts(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens of the last usage object; zeros without one."""
        at = self._tail.rfind(_KEY)
        if at < 0:
            return 0, 0, 0
        text = self._tail[at + len(_KEY) :].decode("utf-8", "replace").lstrip()
        try:
            usage, _ = _DECODER.raw_decode(text)
        except ValueError:
            return 0, 0, 0
        return usage_counts(usage) if isinstance(usage, dict) else (0, 0, 0)
