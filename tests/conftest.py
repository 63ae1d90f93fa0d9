"""Shared pytest fixtures for nanotrain."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from helpers.needs import unavailable
from helpers.runs import SharedRuns


def _unavailable(reason: str) -> None:
    """No usable SLURM cluster: a failure under CI (`make test` as root starts it first), a skip on
    a developer box, where SLURM is optional."""
    unavailable("SLURM cluster", reason, " (start it with: sudo slurm/local-cluster.sh up)")


# Under pytest-xdist (`make test` runs two workers) a group of tests runs whole on one worker, in
# order. The tests that share the local SLURM cluster form one group: the preemption test needs
# both nodes to itself, so they never run beside each other. The tests that read the session's
# shared reference runs form another, so each run is still made once. Both groups come first, so
# the two workers start on them and share out the rest as they free up, a test module at a time:
# a module's own shared work (module fixtures, ``functools.lru_cache`` runs such as
# test_training_pipeline's 8-rank run of every case) is then made once, not once per worker that
# got one of its tests (that run cost ~95 s twice when its tests were dealt out one by one).
#
# How: the workers collect and name each test's group; one of them writes {nodeid: group} to a
# file the controller named (NANOTRAIN_TEST_GROUPS), and the controller's scheduler
# (``GroupScheduling``, a LoadScopeScheduling whose scope is the group) reads it once every
# worker has collected. xdist's own ``--dist loadgroup`` cannot be used: it renames items
# through ``item._nodeid``, which pytest 9 no longer reads, so its groups are silently ignored.
GROUPS = ("slurm", "shared-runs")
GROUPS_ENV = "NANOTRAIN_TEST_GROUPS"


def _group_of(item) -> str | None:
    if item.get_closest_marker("slurm") or "slurm_cluster" in item.fixturenames:
        return "slurm"
    if "shared_runs" in item.fixturenames:
        return "shared-runs"
    return None


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[GROUPS_ENV] = str(Path(tempfile.mkdtemp(prefix="nanotrain-test-groups-")) / "groups.json")


def pytest_collection_modifyitems(config, items):
    groups = {item.nodeid: _group_of(item) for item in items}
    rank = {name: i for i, name in enumerate(GROUPS)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(GROUPS)))  # stable: the rest keep their order
    if os.environ.get("PYTEST_XDIST_WORKER") == "gw0" and os.environ.get(GROUPS_ENV):
        path = Path(os.environ[GROUPS_ENV])
        path.with_suffix(".tmp").write_text(json.dumps({k: v for k, v in groups.items() if v}))
        path.with_suffix(".tmp").replace(path)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling  # only under xdist (a dev dependency)

    class GroupScheduling(LoadScopeScheduling):
        """LoadScopeScheduling with a test's group (``_group_of``) as its scope, else its module."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                path = Path(os.environ[GROUPS_ENV])
                self.groups = json.loads(path.read_text()) if path.is_file() else {}
            return self.groups.get(nodeid, nodeid.split("::", 1)[0])

    return GroupScheduling(config, log)


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
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        _unavailable("`sinfo` timed out (slurmctld not answering)")
    if res.returncode != 0:
        _unavailable(f"`sinfo` failed: {res.stderr.strip()}")
    # A '*' suffix means "not responding"; drained/down nodes can't run jobs either.
    usable = {"idle", "mixed", "allocated", "completing"}
    nodes = sorted(
        name for name, state in (line.split() for line in res.stdout.splitlines() if line.strip()) if state in usable
    )
    if not nodes:
        _unavailable(f"no usable node in partition debug: {res.stdout.strip()!r}")
    return nodes


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """Reference runs of the tiny config made once per session (``helpers.runs.SharedRuns``)."""
    return SharedRuns(tmp_path_factory.mktemp("shared-runs"))
