"""What a test needs from the machine: under CI a missing piece is a failure, elsewhere a skip.

CI runs `make test` as root on the project's Debian machine, which has everything the suite
needs (it starts the SLURM cluster itself; gcc ships with the image), so a missing piece there is
a broken set-up that must not hide behind a skip. On a developer box it may really be absent."""

from __future__ import annotations

import os

import pytest


def unavailable(what: str, reason: str, hint: str = "") -> None:
    """Fail (under ``CI=true``) or skip the test: ``what`` is missing because of ``reason``."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} required under CI: {reason}{hint}", pytrace=False)
    pytest.skip(f"no {what}: {reason}{hint}")
