"""What a command that writes a directory tree leaves behind when it fails: nothing it made.

``first_missing`` names the directories a write would create; ``removed_on_failure`` removes
them, or the entries added to an existing directory, when the block writing there raises.
(Atomic single-file writes live in ``atomic_files.py``.)
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path


def first_missing(path: str | Path) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (what ``mkdir -p`` would make),
    or None when ``path`` exists."""
    path, missing = Path(path).absolute(), None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


@contextlib.contextmanager
def removed_on_failure(directory: str | Path):
    """Run the block that writes into ``directory``; if it raises (Ctrl-C included), remove what
    it made before re-raising: the directory with every parent it created if it did not exist,
    else the entries added to it. So a refusal after writing began leaves nothing behind (an
    entry the block replaced in place cannot be restored: callers check before they write)."""
    made = first_missing(directory)
    before = set() if made is not None else set(Path(directory).iterdir())
    try:
        yield
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        else:
            for entry in set(Path(directory).iterdir()) - before:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        raise
