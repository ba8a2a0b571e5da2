"""The emulator as a process: what a caller that does not speak HTTP/1.1 leaves in its log."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
from urllib.parse import urlsplit

from aiohttp.http_exceptions import BadHttpMessage

from prefix_sidecar_tools.emulator.__main__ import _OneLineBadRequests

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def test_an_http2_preface_is_one_log_line_not_a_traceback() -> None:
    pod = subprocess.Popen(
        [sys.executable, "-m", "prefix_sidecar_tools.emulator", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert pod.stdout is not None
        ready = pod.stdout.readline().split()
        assert ready[:1] == ["READY"], ready
        where = urlsplit(ready[1])
        with socket.create_connection((where.hostname, where.port), timeout=10) as conn:
            conn.sendall(HTTP2_PREFACE)
            answer = conn.recv(4096)
        assert answer.split(b" ", 2)[1] == b"400", answer[:80]
    finally:
        pod.send_signal(signal.SIGTERM)
        _, stderr = pod.communicate(timeout=20)
    assert pod.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    logged = [line for line in stderr.splitlines() if "Error handling request" in line]
    assert len(logged) == 1 and "PRI" in logged[0], stderr[-2000:]


def test_a_bad_request_without_a_message_still_logs_its_kind() -> None:
    try:
        raise BadHttpMessage("")
    except BadHttpMessage:
        failure = sys.exc_info()
    record = logging.LogRecord(
        "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (), failure
    )
    assert _OneLineBadRequests().filter(record)
    assert record.exc_info is None
    assert record.getMessage() == "Error handling request: BadHttpMessage"
