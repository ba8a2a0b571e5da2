"""The routing contract's member ids, and parsing of backend lists and DNS targets."""

from __future__ import annotations

import json

import pytest

from prefix_sidecar.membership.sources import (
    Member,
    canonical_backend_url,
    parse_backends_document,
    parse_dns_target,
)


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("10.0.0.5:8000", "http://10.0.0.5:8000"),
        ("http://10.0.0.5:8000/", "http://10.0.0.5:8000"),
        ("  HTTP://Pod-A.LLM.svc:8000  ", "http://pod-a.llm.svc:8000"),
        (
            "vllm-0.vllm.llm.svc.cluster.local.:8000",
            "http://vllm-0.vllm.llm.svc.cluster.local:8000",
        ),
        ("http://vllm", "http://vllm:80"),
        ("https://vllm", "https://vllm:443"),
        ("https://vllm:8443", "https://vllm:8443"),
        ("[FD00::0001]:8000", "http://[fd00::1]:8000"),
        ("http://[fd00:0:0:0:0:0:0:1]", "http://[fd00::1]:80"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ],
)
def test_canonical_backend_url(raw: str, canonical: str) -> None:
    assert canonical_backend_url(raw) == canonical
    assert canonical_backend_url(canonical) == canonical  # idempotent


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("ftp://x", "backend 'ftp://x' has scheme 'ftp'; use http or https"),
        ("http://user:pw@x:80", "credentials"),
        ("http://x:8000/v1", "has a path '/v1'"),
        ("http://x:8000/?a=1", "query or fragment"),
        ("http://x:8000#frag", "query or fragment"),
        ("http://x:0", "port 0"),
        ("http://x:70000", "not a valid URL"),
        ("http://x:abc", "not a valid URL"),
        ("fd00::1", "brackets"),
        ("http://[fd00::1%eth0]:80", "zone"),
        ("http://10.0.0.05:80", "invalid IPv4"),
        ("http://bad host:80", "invalid host name"),
        ("http://:80", "no host"),
        ("", "empty"),
    ],
)
def test_canonical_backend_url_rejects(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^backend") as info:
        canonical_backend_url(raw)
    assert message in str(info.value)


def test_member_canonicalises_and_validates_weight() -> None:
    assert Member("HTTP://A:8000/") == Member("http://a:8000")
    assert Member("a:1", 3).weight == 3
    for bad in (0, -1, 65537, True, 1.5):
        with pytest.raises(ValueError, match="weight"):
            Member("http://a:1", bad)  # type: ignore[arg-type]


def test_parse_list_mapping_and_json() -> None:
    yaml_text = """
backends:
  - http://10.0.0.1:8000
  - {url: "10.0.0.2:8000", weight: 2}
"""
    expected = [Member("http://10.0.0.1:8000"), Member("http://10.0.0.2:8000", 2)]
    assert parse_backends_document(yaml_text, "f.yaml") == expected
    json_text = json.dumps(["http://10.0.0.1:8000", {"url": "http://10.0.0.2:8000", "weight": 2}])
    assert parse_backends_document(json_text, "f.json") == expected
    assert parse_backends_document("[]", "f.json") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "- a:1\n- A:1\n",
            "src: backends[1]: duplicate backend http://a:1 (already listed at backends[0])",
        ),
        (
            "- {url: a:1, weight: 0}\n",
            "src: backends[0]: backend 'a:1': weight must be 1-65536, got 0",
        ),
        ("- {url: a:1, weight: two}\n", "src: backends[0]: field 'weight' must be an integer"),
        ("- {url: a:1, wieght: 2}\n", "src: backends[0]: unknown field(s) ['wieght']"),
        ("- {weight: 2}\n", "src: backends[0]: missing field 'url'"),
        ("- a:1\n- 42\n", "src: backends[1]: expected a URL string"),
        ("- ftp://a\n", "src: backends[0]: backend 'ftp://a' has scheme 'ftp'"),
        ("servers: [a:1]\n", "src: unknown top-level key(s) ['servers']"),
        ("just text", "src: got str"),
        ("", "src: the document is empty"),
        ("[a:1, b:2", "src: not valid YAML or JSON"),
    ],
)
def test_parse_errors_name_the_entry_and_source(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_backends_document(text, "src")
    assert message in str(info.value)


def test_parse_dns_target() -> None:
    assert parse_dns_target("vllm.llm.svc.cluster.local:8000") == (
        "vllm.llm.svc.cluster.local",
        8000,
    )
    for bad in ("vllm", "vllm:", ":8000", "vllm:0", "vllm:http", "http://vllm:8000", "a b:80"):
        with pytest.raises(ValueError, match="DNS target"):
            parse_dns_target(bad)
