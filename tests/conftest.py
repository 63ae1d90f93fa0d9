"""Shared pytest fixtures for nanotrain."""

import os
import shutil
import subprocess

import pytest

from helpers.runs import SharedRuns


def _unavailable(reason: str) -> None:
    """Fail under CI, skip elsewhere.

    CI runs `make test` as root, which starts the cluster first
    (slurm/local-cluster.sh up), so a missing cluster there is a real breakage that
    must not hide behind a skip. On a developer box SLURM is optional.
    """
    hint = " (start it with: sudo slurm/local-cluster.sh up)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"SLURM cluster required under CI: {reason}{hint}", pytrace=False)
    pytest.skip(f"no usable SLURM cluster: {reason}{hint}")


# Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`) a group runs whole on one
# worker, in order. The tests that share the local SLURM cluster form one group: the preemption test
# needs both nodes to itself, so they never run beside each other. The tests that read the session's
# shared reference runs form another, so each run is still made once. Both groups come first, so
# the two workers start on them and share out the rest as they free up.
GROUPS = ("slurm", "shared-runs")


def _group_of(item) -> str | None:
    if item.get_closest_marker("slurm") or "slurm_cluster" in item.fixturenames:
        return "slurm"
    if "shared_runs" in item.fixturenames:
        return "shared-runs"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    groups = {id(item): _group_of(item) for item in items}
    for item in items:
        if groups[id(item)]:
            item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    rank = {name: i for i, name in enumerate(GROUPS)}
    items.sort(key=lambda item: rank.get(groups[id(item)], len(GROUPS)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def slurm_cluster() -> list[str]:
    """Names of the usable nodes of the default partition of a live SLURM cluster.

    Checked once per session with `sinfo` (a fast, read-only query) rather than by
    submitting a job, so tests that don't need SLURM pay nothing.
    """
    if shutil.which("sinfo") is None:
        _unavailable("`sinfo` not found")
    try:
        res = subprocess.run(
            ["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %T"],
            capture_output=True, text=True, timeout=15,
        )
    except subprocess.TimeoutExpired:
        _unavailable("`sinfo` timed out (slurmctld not answering)")
    if res.returncode != 0:
        _unavailable(f"`sinfo` failed: {res.stderr.strip()}")
    # A '*' suffix means "not responding"; drained/down nodes can't run jobs either.
    usable = {"idle", "mixed", "allocated", "completing"}
    nodes = sorted(
        name for name, state in (line.split() for line in res.stdout.splitlines() if line.strip())
        if state in usable
    )
    if not nodes:
        _unavailable(f"no usable node in partition debug: {res.stdout.strip()!r}")
    return nodes


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """Reference runs of the tiny config made once per session (``helpers.runs.SharedRuns``)."""
    return SharedRuns(tmp_path_factory.mktemp("shared-runs"))
