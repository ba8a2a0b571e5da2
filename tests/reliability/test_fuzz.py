"""Hypothesis drives every sidecar.v1.Router RPC: each of 10,000+ cases gets the status
docs/RELIABILITY.md documents for its input class, with a message; nothing hangs or crashes,
and the sidecar still answers a good request every 250 cases and after each RPC's run.

The generators, the target (an emulator pod and a sidecar, real processes) and the checks
live in prefix_sidecar_tools/fuzz.py and are shared with `prefix-sidecar fuzz --cases N`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from prefix_sidecar_tools.fuzz import RPCS, Fuzzer, over_max_message, split
from tests.cli import run_cli

CI_CASES = 10_000
PLAN = split(CI_CASES)
REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "RELIABILITY.md"


def documented_classes() -> dict[tuple[str, str], frozenset[str]]:
    """(rpc, input class) -> allowed statuses, read from the table in docs/RELIABILITY.md."""
    section = DOCS.read_text().split("## Bad input", 1)[1].split("\n## ", 1)[0]
    table: dict[tuple[str, str], frozenset[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        kinds = re.findall(r"`(\w+)`", cells[0])
        rpcs = re.findall(r"\w+", cells[1])
        statuses = frozenset(re.findall(r"`([A-Z_]+)`", cells[2]))
        for kind in kinds:
            for rpc in rpcs:
                assert rpc in RPCS, f"docs table names an unknown RPC {rpc!r}"
                assert (rpc, kind) not in table, f"docs table lists {rpc}/{kind} twice"
                table[(rpc, kind)] = statuses
    return table


def test_ci_runs_at_least_10000_cases() -> None:
    assert sum(PLAN.values()) >= CI_CASES
    assert set(PLAN) == set(RPCS)


@pytest.mark.parametrize("rpc", RPCS)
def test_every_case_gets_its_documented_status(fuzzer: Fuzzer, rpc: str) -> None:
    before = fuzzer.cases_run
    fuzzer.run(rpc, PLAN[rpc])
    fuzzer.run(rpc, 3, strategy=over_max_message(rpc, fuzzer.target.limits))
    ran = fuzzer.cases_run - before
    # hypothesis may stop early on a tiny search space; ours must not be tiny
    assert ran >= PLAN[rpc], f"only {ran} of {PLAN[rpc]} {rpc} cases ran"
    assert fuzzer.health() == [], "the sidecar stopped serving good requests"

    documented = documented_classes()
    ran_classes = {kind: allowed for (r, kind), allowed in fuzzer.classes.items() if r == rpc}
    for kind, allowed in ran_classes.items():
        assert (rpc, kind) in documented, f"{rpc}/{kind} is not in docs/RELIABILITY.md"
        assert documented[(rpc, kind)] == allowed, f"docs and fuzz disagree on {rpc}/{kind}"
    missing = {k for (r, k) in documented if r == rpc} - set(ran_classes)
    assert not missing, f"documented {rpc} input classes never generated: {sorted(missing)}"


def test_statuses_never_unknown_or_internal(fuzzer: Fuzzer) -> None:
    """Over everything this module ran (the per-case check enforces it too)."""
    assert fuzzer.cases_run >= 1
    statuses = {status for (_, status) in fuzzer.counts}
    assert not statuses & {"UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"}, fuzzer.counts
    assert fuzzer.target.alive()


def test_fuzz_never_logged_prompt_text(fuzzer: Fuzzer) -> None:
    """The sidecar ran at INFO through every case: its log has request lines but not the
    known prefixes' text (sent thousands of times, inline and by reference)."""
    assert fuzzer.cases_run >= 1
    log = fuzzer.target.log_path.read_text()
    assert "Complete prefix=" in log and "Chat prefix=" in log
    assert "careful compliance assistant" not in log


def run_fuzz_command(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("fuzz", *args, timeout=120)


def test_fuzz_command_prints_statuses_per_rpc() -> None:
    result = run_fuzz_command("--cases", "300", "--seed", "7")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = lines[0].split()
    assert header[:2] == ["RPC", "OK"] and header[-1] == "total"
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.split()[0] in RPCS}
    assert set(rows) == set(RPCS)
    assert sum(int(row[-1]) for row in rows.values()) >= 300
    assert "0 failure(s)" in result.stdout


def test_fuzz_command_fails_on_a_hang() -> None:
    """A deadline no call can meet turns every case into a 'hang': exit 1, said why."""
    result = run_fuzz_command("--cases", "8", "--rpc", "Route", "--timeout", "0.000001")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL Route" in result.stdout and "hang" in result.stdout


def test_fuzz_command_refuses_bad_arguments() -> None:
    result = run_fuzz_command("--cases", "0")
    assert result.returncode == 2 and "--cases" in result.stderr
