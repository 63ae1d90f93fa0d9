"""The files every generated case points at, made once per fuzz run in a temporary folder:

- `@cfg@`: the case's config (the shipped tiny_cpu.yaml unless the case brings its own text);
- `@ckpt@` / `@step@`: a tiny one-process checkpoint (checkpoints root / its step directory), for
  export_hf and reshard_checkpoint; `@hf@`: that checkpoint exported as a Hugging Face directory;
- `@out@`: a path that does not exist yet, inside a folder watched for writes;
- hostile paths (HOSTILE): a FIFO, a folder whose config.json is a FIFO, a symlink loop and a path
  under it, a 256-byte name component (and a path under it), paths under /proc and /sys, a broken
  symlink, a folder where a file is expected, a file where a folder is expected, an unreadable
  file, /dev/null and a recursive glob of the whole file system.

Placeholders are `@name@` tokens inside argv strings and config text (braces stay YAML's).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"

# name -> what it is; every one is given to every path field and path argument. /proc and /sys
# targets are read-only or cannot be created, even as root (never /proc/sys: root could write it).
HOSTILE = {
    "fifo": "a FIFO",
    "fifo_hf": "a folder whose config.json is a FIFO",
    "loop": "a symlink loop",
    "under_loop": "a path under a symlink loop",
    "long": "a 256-byte name component",
    "under_long": "a path under a 256-byte name component",
    "proc_file": "/proc/self/status",
    "proc_dir": "/proc/self",
    "proc_new": "a new path under /proc",
    "sys_new": "a new path under /sys",
    "sys_dir": "/sys/kernel",
    "broken": "a broken symlink",
    "dir": "a folder where a file is expected",
    "file": "a file where a folder is expected",
    "unreadable": "a file with mode 000",
    "devnull": "/dev/null",
    "glob_root": "a recursive glob of the whole file system",
}
# Given to outputs instead of HOSTILE's glob: a folder may be created under a glob's name, and a
# glob of the root then writes into the real "/**" (never outside the workspace).
HOSTILE_OUT = {**{k: v for k, v in HOSTILE.items() if k != "glob_root"}, "glob_ws": "a glob as a folder name"}


def hostile_for(role: str) -> dict[str, str]:
    """The hostile paths given to an input ("in", "name") or an output ("out") path."""
    return HOSTILE_OUT if role == "out" else HOSTILE  # "in", "data", "name": read, never created


class Workspace:
    """A temporary folder with the hostile paths, the checkpoint and the watched folders."""

    def __init__(self, with_checkpoint: bool = True):
        self._tmp = tempfile.TemporaryDirectory(prefix="fuzz_config_")
        self.root = Path(self._tmp.name)
        self.cwd = self.root / "cwd"
        self.outs = self.root / "out"
        h = self.root / "h"
        for d in (self.cwd, self.outs, h, h / "adir", h / "fifohf"):
            d.mkdir()
        os.mkfifo(h / "fifo")
        os.mkfifo(h / "fifohf" / "config.json")
        (h / "loop").symlink_to(h / "loop")
        (h / "broken").symlink_to(h / "missing")
        (h / "afile").write_text("not: [yaml\n")
        (h / "unreadable").write_text("parallelism: {dp: 1}\n")
        (h / "unreadable").chmod(0)
        # root reads a mode-000 file: there it is an ordinary file, and either answer is right
        self.reads_unreadable = os.access(h / "unreadable", os.R_OK)
        long = "x" * 256
        self.paths = {
            "fifo": str(h / "fifo"),
            "fifo_hf": str(h / "fifohf"),
            "loop": str(h / "loop"),
            "under_loop": str(h / "loop" / "config.yaml"),
            "long": str(h / long),
            "under_long": str(h / long / "config.yaml"),
            "proc_file": "/proc/self/status",
            "proc_dir": "/proc/self",
            "proc_new": "/proc/nanotrain_fuzz/x",
            "sys_new": "/sys/kernel/nanotrain_fuzz/x",
            "sys_dir": "/sys/kernel",
            "broken": str(h / "broken"),
            "dir": str(h / "adir"),
            "file": str(h / "afile"),
            "unreadable": str(h / "unreadable"),
            "devnull": "/dev/null",
            "glob_root": "/**/*.parquet",
            "glob_ws": str(h / "**" / "*.parquet"),
            "long_name": long,
            "cfg": str(self.root / "cfg.yaml"),
            "out": str(self.outs / "new"),
            "tmp": str(self.root),
        }
        self.ckpt = self.root / "ckpt"
        if with_checkpoint:
            self._build_checkpoint()

    def _build_checkpoint(self) -> None:
        from fuzzing.checkpoint import export_tiny_hf, save_tiny

        step = save_tiny(self.ckpt)
        self.paths.update(ckpt=str(self.ckpt), step=str(step), hf=str(self.root / "hf"))
        export_tiny_hf(self.ckpt, self.root / "hf")

    def resolve(self, text: str) -> str:
        return re.sub(r"@(\w+)@", lambda m: self.paths[m.group(1)], text)

    def watched(self) -> list[Path]:
        """Folders in which a refused case must change nothing (the checkpoint included: SRC = DST)."""
        return [self.cwd, self.outs, self.ckpt]

    def reset(self) -> None:
        """Remove what a case wrote in the scratch folders and the hostile folders an accepted
        output may legitimately fill (a reshard into the FIFO folder writes a checkpoint there,
        which would make it a valid data source for the cases after it); the checkpoint is
        rebuilt if touched."""
        fifo_hf = self.root / "h" / "fifohf"
        for top in (self.cwd, self.outs, self.root / "h" / "adir", fifo_hf):
            for entry in top.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                elif not (top == fifo_hf and entry.name == "config.json" and entry.is_fifo()):
                    entry.unlink(missing_ok=True)
        if not (fifo_hf / "config.json").is_fifo():
            os.mkfifo(fifo_hf / "config.json")

    def rebuild_checkpoint(self) -> None:
        shutil.rmtree(self.ckpt, ignore_errors=True)
        from fuzzing.checkpoint import save_tiny

        save_tiny(self.ckpt)

    def close(self) -> None:
        (self.root / "h" / "unreadable").chmod(0o600)
        self._tmp.cleanup()
