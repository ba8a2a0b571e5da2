"""The token usage of an answer relayed as bytes, for the same metrics as the gRPC path.

vLLM writes `usage` last (end of a whole JSON answer; last event before [DONE] of a stream with
`stream_options.include_usage`), so only the last TAIL_BYTES are kept (amortized O(bytes
relayed)) and the last `"usage":` in them is decoded once, at the end. Generated text cannot
fake the key: inside a JSON string a quote is escaped.
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
