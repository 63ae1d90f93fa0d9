"""One checker for every path a user gives: config fields, submit.py arguments, script arguments.

`path_problem(name, path, expect)` returns one line, ``"<name>: <what is wrong>: <the fix>"``, or
None. It only stats (``os.stat`` / ``os.lstat``, catching the errno), so it never hangs and never
walks unboundedly: a symbolic-link loop is the kernel's ELOOP, and a FIFO, socket or device where
a file is expected is refused from its mode bits *before* anything opens it (opening a FIFO for
reading blocks until a writer comes). What `expect` can be:

    FILE        an existing regular file to read
    DIR         an existing directory to read
    FILE_OR_DIR an existing regular file or directory to read (a data source)
    CREATE_DIR  a directory that exists or can be made, and that we may write in

Pseudo file systems (proc, sysfs, devtmpfs, cgroup, ...) hold the kernel's views, not data: a
path on one is refused whatever `expect` is. Two signals, because neither alone is enough: the
mount table (/proc/self/mountinfo, the longest mount point above the path's real location)
catches such a file system wherever it is mounted and through symbolic links; the names /proc,
/sys and /dev catch what containers mount there as plain tmpfs (here /sys/fs/cgroup; Docker's
/dev). /dev/shm, the conventional RAM scratch space, is allowed.

`bounded_glob` expands a data-file pattern with the same care: it lists at most `MAX_DIRS`
directories, enters each directory once while expanding ``**`` (a link loop is not walked round),
and never enters a pseudo file system. Torch-free and dependency-free: the config layer is the bottom one.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
from functools import lru_cache

FILE, DIR, FILE_OR_DIR, CREATE_DIR = "file", "dir", "file or dir", "create dir"
NAME_MAX = 255  # bytes of one name: ext4, xfs, btrfs, NFS, Lustre and GPFS all allow 255
PATH_MAX = 4096  # bytes of a whole path (Linux PATH_MAX, with its NUL)
MAX_DIRS = 10_000  # directories one glob may visit: quick locally, still seconds on a network file system
PSEUDO_TYPES = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "mqueue",
        "binfmt_misc",
        "efivarfs",
        "selinuxfs",
        "rpc_pipefs",
        "nsfs",
        "autofs",
        "hugetlbfs",
    }
)
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")
_ALLOWED_UNDER_PSEUDO = ("/dev/shm",)
_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class PathError(ValueError):
    """A path a user gave that cannot be used; the message is one line naming the field."""


def check_path(name: str, path, expect: str, error: type[Exception] = PathError, missing: str | None = None) -> str:
    """Raise `error` (one line) if `path` is not what `expect` says; return it, `~` expanded.
    `missing`: the whole line to say when nothing is there (the caller knows the better fix)."""
    found = path_problem(name, path, expect, missing)
    if found:
        raise error(found)
    return os.path.expanduser(str(path))


def path_problem(name: str, path, expect: str, missing: str | None = None) -> str | None:
    """Why `path`, given as `name` (field or argument), cannot be used as `expect`; None if it can."""
    if path is None or not str(path).strip():
        return f"{name}: an empty path (an unset shell variable?): give a path"
    path = os.path.expanduser(str(path))
    found = _name_problem(name, path)
    if found:
        return found
    full = os.path.abspath(path)
    if expect == CREATE_DIR:
        return _create_problem(name, full)
    try:
        st = os.stat(full)
    except OSError as exc:
        if missing and exc.errno == errno.ENOENT and not _is_link(full):
            return missing
        return _stat_problem(name, full, exc)
    found = _pseudo_problem(name, full)
    if found:
        return found
    return _kind_problem(name, full, st, expect)


def _name_problem(name: str, path: str) -> str | None:
    if "\0" in path:
        return f"{name}: the path contains a NUL byte, which no file name can hold: remove it"
    raw = os.fsencode(path)
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            shown = os.fsdecode(part)[:40]
            return (
                f"{name}: the name {shown!r}... is {len(part)} bytes; file systems allow {NAME_MAX}: "
                "choose a shorter name"
            )
    if len(raw) >= PATH_MAX:
        return f"{name}: the path is {len(raw)} bytes long; at most {PATH_MAX - 1}: choose a shorter one"
    return None


def _stat_problem(name: str, path: str, exc: OSError) -> str:
    """An os.stat failure as one line; ENOENT distinguishes a broken link from a missing name."""
    if exc.errno == errno.ENOENT:
        if _is_link(path):
            return f"{name}: {path} is a broken symbolic link: fix it or give another path"
        return f"{name}: no such file or directory {path}: check the path"
    if exc.errno == errno.ELOOP:
        return f"{name}: {path} is a symbolic link loop (or over 40 links deep): fix the links or give another path"
    if exc.errno == errno.ENAMETOOLONG:
        return f"{name}: {path[:60]}... is longer than the file system allows: choose a shorter path"
    if exc.errno == errno.ENOTDIR:
        return f"{name}: a part of {path} is a file, not a directory: check the path"
    if exc.errno == errno.EACCES:
        return f"{name}: {path} cannot be reached (permission denied on a directory above it): check permissions"
    return f"{name}: {path}: {exc.strerror or exc}"


def _is_link(path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def _kind_name(mode: int) -> str | None:
    return next((what for test, what in _KINDS if test(mode)), None)


def _kind_problem(name: str, path: str, st: os.stat_result, expect: str) -> str | None:
    mode = st.st_mode
    other = _kind_name(mode)
    if expect in (FILE, FILE_OR_DIR) and stat.S_ISREG(mode):
        return None if os.access(path, os.R_OK) else f"{name}: {path} is not readable by you: check its permissions"
    if expect in (DIR, FILE_OR_DIR) and stat.S_ISDIR(mode):
        return (
            None
            if os.access(path, os.R_OK | os.X_OK)
            else f"{name}: {path} is a directory you may not read: check its permissions"
        )
    wanted = {FILE: "a regular file", DIR: "a directory", FILE_OR_DIR: "a regular file or a directory"}[expect]
    found = other or ("a directory" if stat.S_ISDIR(mode) else "a file")
    return f"{name}: {path} is {found}, not {wanted}: give {wanted}"


def _create_problem(name: str, path: str) -> str | None:
    """The nearest existing ancestor must be a directory we may write in (a mkdir -p would work)."""
    probe = path
    while True:
        try:
            st = os.stat(probe)
            break
        except OSError as exc:
            if exc.errno == errno.ENOENT and not _is_link(probe) and probe != os.path.dirname(probe):
                probe = os.path.dirname(probe)
                continue
            if exc.errno == errno.ENOTDIR:
                probe = os.path.dirname(probe)  # an ancestor is a file: said below
                continue
            if exc.errno == errno.ENOENT:
                return f"{name}: {probe} is a broken symbolic link: fix it or choose another directory"
            return _stat_problem(name, probe, exc)
    found = _pseudo_problem(name, probe)
    if found:
        return found
    if not stat.S_ISDIR(st.st_mode):
        what = _kind_name(st.st_mode) or "a file"
        return f"{name}: {probe} is {what}, not a directory: choose another {name} (or move the file away)"
    if not os.access(probe, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
        why = "is on a read-only file system" if read_only else "is not writable by you"
        return f"{name}: {probe} {why}: choose a writable {name}"
    return None


def _pseudo_problem(name: str, path: str) -> str | None:
    fs = pseudo_fs(path)
    if fs:
        return (
            f"{name}: {path} is on the {fs} pseudo file system (the kernel's view, not files): "
            "give a path on a real file system"
        )
    return None


def pseudo_fs(path: str) -> str | None:
    """The type of the pseudo file system `path` (an existing path) is on, else None."""
    real = os.path.realpath(path)
    if real.startswith(_ALLOWED_UNDER_PSEUDO) and _under(real, _ALLOWED_UNDER_PSEUDO[0]):
        return None
    mounts = _mount_table()
    best = max((m for m in mounts if _under(real, m)), key=len, default=None)
    if best is not None and mounts[best] in PSEUDO_TYPES:
        return mounts[best]
    root = next((r for r in PSEUDO_ROOTS if _under(real, r)), None)
    return {"/proc": "proc", "/sys": "sysfs", "/dev": "devtmpfs"}[root] if root else None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@lru_cache(maxsize=1)
def _mount_table() -> dict[str, str]:
    """Mount point -> file system type, from /proc/self/mountinfo ({} where there is none)."""
    table = {}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields, types = left.split(), right.split()
                if len(fields) >= 5 and types:
                    point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: space
                    table[point] = types[0]
    except OSError:
        pass
    return table


def pseudo_mount_points() -> frozenset[str]:
    """Mount points of pseudo file systems, and the pseudo roots: where a walk must not go."""
    return frozenset(p for p, t in _mount_table().items() if t in PSEUDO_TYPES) | frozenset(PSEUDO_ROOTS)


def bounded_glob(name: str, pattern: str, max_dirs: int = MAX_DIRS) -> list[str]:
    """The regular files matching `pattern` (glob syntax, ``**`` = any directories), sorted.

    As ``glob.glob(recursive=True)`` (names starting with '.' match only a component that starts
    with '.'; ``**`` follows links to directories), except that ``**`` never enters a directory
    that is its own ancestor (by device and inode: a link loop is not walked round), pseudo file
    systems are never entered, FIFOs, sockets and devices never match, and more than `max_dirs`
    directories listed raise PathError: "the pattern ... visits more than N directories: narrow it"."""
    path = os.path.expanduser(pattern)
    found = _name_problem(name, path)
    if found:
        raise PathError(found)
    parts = path.split("/")
    magic = next((i for i, p in enumerate(parts) if _is_magic(p)), len(parts))
    root = "/".join(parts[:magic]) or ("/" if path.startswith("/") else ".")
    if os.path.isdir(root):
        found = _pseudo_problem(name, os.path.abspath(root))
        if found:
            raise PathError(found)
    walk = _Walk(
        max_dirs, f"{name}: the pattern {pattern} visits more than {max_dirs:,} directories: narrow it", follow=True
    )
    return sorted(set(walk.expand(root, [p for p in parts[magic:] if p], False, frozenset())))


def walk_files(name: str, directory: str, max_dirs: int = MAX_DIRS) -> list[str]:
    """The regular files below `directory` (names not starting with '.'), sorted, walked as
    ``os.walk`` walks (links to directories are not entered), never into a pseudo file system,
    at most `max_dirs` directories (else PathError naming `name`)."""
    walk = _Walk(
        max_dirs,
        f"{name}: {directory} holds more than {max_dirs:,} directories: give a narrower directory or a glob",
        follow=False,
    )
    return sorted(walk.expand(directory, ["**", "*"], False, frozenset()))


def _is_magic(part: str) -> bool:
    return any(c in part for c in "*?[")


class _Walk:
    """One bounded expansion: counts the directories it lists and raises `too_many` past the cap;
    `follow`: whether ``**`` enters links to directories (never one that is its own ancestor)."""

    def __init__(self, max_dirs: int, too_many: str, follow: bool):
        self.max_dirs, self.too_many, self.follow = max_dirs, too_many, follow
        self.skip, self.visited = pseudo_mount_points(), 0

    def _entries(self, directory: str, linked: bool) -> list[os.DirEntry]:
        # Reached through a link, a path's text says nothing of where it is: ask the kernel.
        where = os.path.realpath(directory) if linked else os.path.normpath(os.path.abspath(directory))
        if where in self.skip:
            return []
        self.visited += 1
        if self.visited > self.max_dirs:
            raise PathError(self.too_many)
        try:
            with os.scandir(directory) as it:
                return list(it)
        except OSError:
            return []  # unreadable or vanished: glob skips it too

    def expand(self, base: str, parts: list[str], linked: bool, ancestors: frozenset) -> list[str]:
        """Matches of `parts` below `base`; `linked`: a link was followed on the way; `ancestors`:
        (device, inode) of the directories ``**`` went through, so a loop ends at once."""
        if not parts:
            return [base] if _regular(base) else []
        head, rest = parts[0], parts[1:]
        if head == "**":
            try:
                st = os.stat(base)
            except OSError:
                return []
            if (st.st_dev, st.st_ino) in ancestors:
                return []
            ancestors = ancestors | {(st.st_dev, st.st_ino)}
            out = self.expand(base, rest, linked, ancestors)
            for entry in self._entries(base, linked):
                link = entry.is_symlink()
                if not entry.name.startswith(".") and (self.follow or not link) and _is_dir(entry):
                    out += self.expand(entry.path, parts, linked or link, ancestors)
            return out
        if not _is_magic(head):
            nxt = os.path.join(base, head)
            return self.expand(nxt, rest, linked or _is_link(nxt), ancestors) if os.path.lexists(nxt) else []
        out = []
        for entry in self._entries(base, linked):
            if entry.name.startswith(".") and not head.startswith("."):
                continue
            if fnmatch.fnmatchcase(entry.name, head) and (not rest or _is_dir(entry)):
                out += self.expand(entry.path, rest, linked or entry.is_symlink(), ancestors)
        return out


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _regular(path: str) -> bool:
    """A regular file (after links): FIFOs, sockets and devices never match a data pattern."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False
