"""The tuned launcher (prefix_sidecar_tools/tuned.py): how a bench runs `serve` with a tuning
constant that is no config field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefix_sidecar.config import FIELDS, REMOVED_FIELDS
from prefix_sidecar.membership.load_signals import poller
from prefix_sidecar.routing import organic
from prefix_sidecar_tools import tuned


def test_every_tunable_names_an_existing_constant_and_a_former_field() -> None:
    for name, (module_name, constant) in tuned.TUNABLES.items():
        module = __import__(module_name, fromlist=[constant])
        assert hasattr(module, constant), name
        assert name not in FIELDS and constant in REMOVED_FIELDS[name], name


def test_fields_go_to_set_and_tunables_to_the_launcher() -> None:
    args, launcher = tuned.serve_settings({"grace_s": 1, "organic_balance_starts": False})
    assert args == ["--set", "grace_s=1"]
    assert launcher == [*tuned.LAUNCHER, "--tune", "organic_balance_starts=False"]
    assert tuned.serve_settings({"grace_s": 1})[1] == ["-m", "prefix_sidecar.cli"]
    with pytest.raises(ValueError, match="'load_factr' is neither a config field nor a tunable"):
        tuned.serve_settings({"load_factr": 1.5})


def test_apply_sets_each_constant_in_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(organic, "BALANCE_STARTS", organic.BALANCE_STARTS)
    monkeypatch.setattr(poller, "POLL_INTERVAL_S", poller.POLL_INTERVAL_S)
    tuned.apply(["organic_balance_starts=False", "load_poll_interval_s=1"])
    assert organic.BALANCE_STARTS is False
    assert poller.POLL_INTERVAL_S == 1.0 and isinstance(poller.POLL_INTERVAL_S, float)
    with pytest.raises(SystemExit, match="is a bool"):
        tuned.apply(["organic_balance_starts=often"])
    with pytest.raises(SystemExit, match="want NAME=VALUE"):
        tuned.apply(["vnodes=8"])


def test_the_launcher_runs_serve() -> None:
    command = [sys.executable, "-m", "prefix_sidecar_tools.tuned", "--tune", "policy=round_robin"]
    printed = subprocess.run(
        [*command, "serve", "--print-config"], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0, printed.stderr
    assert '"load_signals": true' in printed.stdout
