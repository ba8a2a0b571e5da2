"""The one host:port parser (prefix_sidecar/hostport.py), and the parsers that now use it."""

from __future__ import annotations

import pytest

from prefix_sidecar.hostport import split_host_port
from prefix_sidecar.membership.sources import parse_dns_target


@pytest.mark.parametrize(
    ("text", "default_port", "expected"),
    [
        ("10.0.0.5:8000", None, ("10.0.0.5", 8000)),
        ("  vllm.svc:80  ", None, ("vllm.svc", 80)),
        ("[fd00::1]:53", None, ("fd00::1", 53)),
        ("[fd00::1]", 53, ("fd00::1", 53)),
        ("fd00::1", 53, ("fd00::1", 53)),  # bare IPv6: never host "fd00:" port 1
        ("::1", 53, ("::1", 53)),
        ("10.96.0.10", 53, ("10.96.0.10", 53)),
        ("10.96.0.10:5353", 53, ("10.96.0.10", 5353)),
        ("host:65535", None, ("host", 65535)),
    ],
)
def test_split(text: str, default_port: int | None, expected: tuple[str, int]) -> None:
    assert split_host_port(text, default_port=default_port) == expected


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("host", "has no port"),
        ("fd00::1", "[address]:port"),
        ("[fd00::1]", "has no port"),
        ("host:", "port '' must be 1-65535"),
        ("host:0", "port '0' must be 1-65535"),
        ("host:65536", "must be 1-65535"),
        ("host:http", "port 'http'"),
        (":8000", "has no host"),
        ("[]:53", "has no host"),
        ("[fd00::1:53", "closing ']'"),
        ("[fd00::1]x53", "closing ']'"),
        ("http://host:80", "without a scheme"),
        ("", "has no host"),
    ],
)
def test_refuses(text: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        split_host_port(text)
    assert words in str(info.value)


def test_not_text() -> None:
    with pytest.raises(ValueError, match="not text"):
        split_host_port(8000)  # type: ignore[arg-type]


def test_example_is_in_the_message() -> None:
    with pytest.raises(ValueError, match=r"e\.g\. 'ns:53'"):
        split_host_port("ns", example="'ns:53'")


def test_dns_target_uses_it_and_wants_a_name() -> None:
    assert parse_dns_target("vllm-headless.llm.svc:8000") == ("vllm-headless.llm.svc", 8000)
    for bad in ("[fd00::1]:8000", "a/b:80", "vllm"):
        with pytest.raises(ValueError, match="DNS target"):
            parse_dns_target(bad)
