"""The README's first lines are the two commands, and its config reference is the schema's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_commands_first():
    head = (ROOT / "README.md").read_text().splitlines()[:6]
    assert any(line.startswith("make run") for line in head)
    assert any(line.startswith("make test") for line in head)


def test_config_reference_is_current():
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_reference.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    readme = (ROOT / "README.md").read_text()
    assert generated in readme, "README config reference is stale: run scripts/config_reference.py"
