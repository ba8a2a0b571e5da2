"""A bad config fails at start, exit 2, naming the field and the reason: a broken ConfigMap is
caught by the pod's first start, not by its first request.

Most cases call the real `prefix-sidecar` entry point in this process (it fails before any
socket or task exists); a few run it as a process, as Kubernetes would.
"""

from __future__ import annotations

import grp
import os
import subprocess
from pathlib import Path

import pytest

from prefix_sidecar import cli
from prefix_sidecar_tools.harness import child_env
from tests.cli import run_cli

# (field, bad value as given to --set). Each must fail naming the field.
BAD_SETTINGS = [
    ("load_factor", "0.5"),
    ("load_factor", "abc"),
    ("replicas", "0"),
    ("replicas", "two"),
    ("max_attempts", "0"),
    ("eject_after_failures", "0"),
    ("health_interval_s", "0"),
    ("health_timeout_s", "-1"),
    ("connect_timeout_s", ".nan"),
    ("upstream_timeout_s", ".inf"),
    ("first_token_timeout_s", "0"),
    ("dns_interval_s", "0"),
    ("file_interval_s", "-0.5"),
    ("grace_s", "-1"),
    ("max_prefix_bytes", "0"),
    ("max_input_bytes", "-5"),
    ("max_prefixes", "0"),
    ("max_message_bytes", "0"),
    ("per_backend_connections", "0"),
    ("metrics_port", "70000"),
    ("metrics_port", "http"),
    ("socket_mode", "rw-rw----"),
    ("socket_mode", "'1777'"),
    ("socket_group", "no-such-group-for-prefix-sidecar"),
    ("warm_before_serve", "maybe"),
    ("health_path", "health"),
    ("log_level", "loud"),
    ("prices", "-1,0.2,6"),
    ("prices", "2,0.2,cheap"),
    ("prices", "2,0.2"),
    ("listen", "tcp://127.0.0.1:5000"),
    ("listen", "unix://"),
    ("tcp_listen", "nowhere"),
    ("tcp_listen", "127.0.0.1:0"),
    ("tcp_listen", "127.0.0.1:8443"),  # without tls_cert_file/tls_key_file
    ("api_key_file", "/nonexistent/prefix-sidecar-key"),
    ("backends", "[{url: 'http://127.0.0.1:1', weight: 0}]"),
    ("backends", "[7]"),
    ("prefixes", "[{name: x}]"),
    ("prefixes", "[{name: x, file: y, colour: red}]"),
    ("model", "[a, b]"),
]


def serve(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["serve", "--listen", "unix:///tmp/prefix-sidecar-badconfig.sock", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("field", "value"), BAD_SETTINGS)
def test_bad_field_is_named_at_start(
    field: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = serve(["--backend", "http://127.0.0.1:1", "--set", f"{field}={value}"], capsys)
    assert code == 2, err
    assert f"'{field}'" in err, err
    assert err.startswith("prefix-sidecar: bad config:"), err
    assert "Traceback" not in err
    assert not Path("/tmp/prefix-sidecar-badconfig.sock").exists()


def test_tls_files_must_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    args = ["--backend", "http://127.0.0.1:1", "--set", "tcp_listen=127.0.0.1:8443"]
    code, err = serve(
        [*args, "--set", f"tls_cert_file={cert}", "--set", "tls_key_file=/nonexistent/key.pem"],
        capsys,
    )
    assert code == 2 and "'tls_key_file'" in err and "/nonexistent/key.pem" in err
    code, err = serve(
        [*args, "--set", f"tls_cert_file={cert}", "--set", f"tls_key_file={cert}",
         "--set", "tls_client_ca_file=/nonexistent/ca.pem"],
        capsys,
    )  # fmt: skip
    assert code == 2 and "'tls_client_ca_file'" in err


def test_unknown_field_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = serve(["--backend", "http://127.0.0.1:1", "--set", "load_factr=1.5"], capsys)
    assert code == 2
    assert "unknown config field 'load_factr'" in err and "load_factor" in err


def test_set_without_equals(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = serve(["--backend", "http://127.0.0.1:1", "--set", "load_factor"], capsys)
    assert code == 2 and "FIELD=VALUE" in err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("listen: [unclosed\n", "is not valid YAML"),
        ("- a\n- b\n", "must hold a mapping of fields"),
        ("backends: [http://127.0.0.1:1]\nload_factr: 2\n", "unknown config field 'load_factr'"),
        ("backends: [http://127.0.0.1:1]\nreplicas: -3\n", "'replicas' must be >= 1"),
        ("backends: [http://127.0.0.1:1]\nmax_attempts: [1]\n", "'max_attempts'"),
        ("\tbackends: x\n", "is not valid YAML"),
    ],
)
def test_bad_config_file(
    content: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text(content)
    code, err = serve(["--config", str(path)], capsys)
    assert code == 2, err
    assert expected in err, err
    assert "Traceback" not in err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = serve(["--config", str(tmp_path / "absent.yaml")], capsys)
    assert code == 2 and "cannot read config file" in err and "absent.yaml" in err


def test_bad_env_var_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PREFIX_SIDECAR_LOAD_FACTOR", "heavy")
    code, err = serve(["--backend", "http://127.0.0.1:1"], capsys)
    assert code == 2 and "'load_factor'" in err and "heavy" in err


def test_a_good_group_passes_validation(capsys: pytest.CaptureFixture[str]) -> None:
    """The socket_group check must not refuse a real group (the control for the case above)."""
    group = grp.getgrgid(os.getgid()).gr_name
    code, err = serve(
        ["--backend", "http://127.0.0.1:1", "--set", f"socket_group={group}", "--print-config"],
        capsys,
    )
    assert code == 0, err


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("serve", *args, env={**child_env(), **(env or {})})


def test_as_a_process_bad_fields_exit_2(tmp_path: Path) -> None:
    sock = f"unix://{tmp_path}/s.sock"
    for field, value in [("load_factor", "0.5"), ("socket_group", "no-such-group-xyz")]:
        result = run_serve("--listen", sock, "--backend", "http://127.0.0.1:1", "--set",
                           f"{field}={value}")  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert f"'{field}'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "s.sock").exists()


def test_as_a_process_start_errors_exit_2(tmp_path: Path) -> None:
    """Errors found while starting (not in the config itself) also exit 2 with a reason."""
    sock = f"unix://{tmp_path}/s.sock"
    result = run_serve("--listen", sock)
    assert result.returncode == 2 and "no backends configured" in result.stderr
    missing = tmp_path / "rules.txt"
    result = run_serve("--listen", sock, "--backend", "http://127.0.0.1:1", "--prefix",
                       f"rules={missing}")  # fmt: skip
    assert result.returncode == 2 and "rules" in result.stderr and str(missing) in result.stderr
    (tmp_path / "not-a-socket").write_text("precious")
    result = run_serve("--listen", f"unix://{tmp_path}/not-a-socket", "--backend", "http://x:1")
    assert result.returncode == 2 and "is not a socket" in result.stderr
    assert (tmp_path / "not-a-socket").read_text() == "precious"
