"""Every path a user gives goes through one checker (nanotrain/config/paths.py). Every path-typed
config field (enumerated from the schema's `doc(path=...)` marks, so a new one is covered without
being listed here), every submit.py path argument and every script path argument is given a FIFO,
a symbolic-link loop, a 256-byte name and a path under /proc: each is one `error:` line naming
the field or argument, exit 2, within 2 s, nothing written. In-process calls; a hang (a FIFO
opened for reading) is ended by SIGALRM after 10 s and fails the test."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from nanotrain.config.path_fields import path_fields
from nanotrain.config.paths import (
    CREATE_DIR,
    DIR,
    FILE,
    MAX_DIRS,
    PathError,
    bounded_glob,
    path_problem,
    pseudo_fs,
    walk_files,
)
from nanotrain.config.schema import DATA_SOURCE, HF_DIR, TOKENIZER

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
BAD = ("fifo", "loop", "long", "proc")
# A list-typed path field needs the other keys its entries require.
LIST_ENTRY = {"data.sources": "{{name: s0, {leaf}: {value}}}", "eval.sources": "{{name: e0, {leaf}: {value}}}"}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _bad_path(kind: str, tmp: Path) -> str:
    if kind == "fifo":
        os.mkfifo(tmp / "fifo")
        return str(tmp / "fifo")
    if kind == "loop":
        os.symlink("loop", tmp / "loop")
        return str(tmp / "loop")
    if kind == "long":
        return str(tmp / ("x" * 256))
    return "/proc/self"


def _tree(root: Path) -> list:
    return sorted((d, sorted(dirs), sorted(files)) for d, dirs, files in os.walk(root))


def _refused(call, tmp: Path, name: str, capsys) -> None:
    """`call()` refuses in one `error:` line naming `name`, exit 2, within 2 CPU s (a hang is
    caught by the 10 s alarm), writing nothing."""
    before = _tree(tmp)

    def hang(*_):
        raise TimeoutError(f"{name}: no answer within 10 s (a FIFO opened?)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    try:
        start = time.process_time()  # CPU seconds: wall time on a loaded machine measures the machine
        code = call()
        seconds = time.process_time() - start
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {name}: "), (code, err)
    assert "Traceback" not in err and seconds < 2.0, seconds
    assert _tree(tmp) == before


def _override(field: str, value: str) -> list[str]:
    if "[]." in field:
        head, leaf = field.split("[].")
        return ["--set", f"{head}=[{LIST_ENTRY[head].format(leaf=leaf, value=value)}]"]
    return ["--set", f"{field}={value}"]


def test_the_schema_marks_every_path_field():
    """The enumeration the tests below rely on finds the fields known today (a mark dropped by
    an edit of schema.py would silently take a field out of the checks)."""
    found = dict(path_fields())
    assert found == {
        "data.source": DATA_SOURCE,
        "data.tokenizer": TOKENIZER,
        "data.sources[].source": DATA_SOURCE,
        "data.validation.source": DATA_SOURCE,
        "data.cache_dir": "create dir",
        "eval.sources[].source": DATA_SOURCE,
        "checkpoints.path": "create dir",
        "checkpoints.init_from_hf": HF_DIR,
        "logging.dir": "create dir",
    }
    assert all(f.split("[]")[0] in LIST_ENTRY for f in found if "[]" in f)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("field", [f for f, _ in path_fields()])
def test_every_path_field(field, bad, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"  # a small real source: the stdlib walk would cost time
    corpus.write_text("def f(x):\n    return x + 1\n" * 1000)
    value = _bad_path(bad, tmp_path)
    base = [] if field.startswith("data.source") else ["--set", f"data.source={corpus}"]
    if field == "data.validation.source":
        base += ["--set", "data.validation.fraction=null"]
    argv = [TINY, "--dry-run", *base, *_override(field, value)]
    _refused(lambda: _cli(argv), tmp_path, field.replace("[]", "[0]"), capsys)


def _cli(argv) -> int:
    from nanotrain.commands.cli import main

    return main([str(a) for a in argv])


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize(
    "argv,name",
    [
        (["{bad}", "--dry-run"], "config file"),
        (["--status", "{bad}"], "--status"),
        (["--resume", "{bad}"], "--resume"),
        ([str(TINY), "--emit", "{bad}"], "--emit"),
    ],
)
def test_every_submit_path_argument(argv, name, bad, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    value = _bad_path(bad, tmp_path)
    _refused(lambda: _cli([a.format(bad=value) for a in argv]), tmp_path, name, capsys)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize(
    "script,argv,name",
    [
        ("export_hf", ["{bad}", "{tmp}/out"], "SRC"),
        ("export_hf", ["{tmp}", "{bad}"], "OUT_DIR"),
        ("reshard_checkpoint", ["{bad}", "{tmp}/out", "--set", "parallelism.dp=1"], "SRC"),
        ("reshard_checkpoint", ["{tmp}", "{bad}", "--set", "parallelism.dp=1"], "DST"),
        ("hf_config", ["{bad}"], "PATH"),
        ("inspect_topology", ["{bad}"], "config file"),
    ],
)
def test_every_script_path_argument(script, argv, name, bad, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = _script(script)
    value = _bad_path(bad, tmp_path)
    _refused(lambda: main([a.format(bad=value, tmp=tmp_path) for a in argv]), tmp_path, name, capsys)


def test_hf_files_are_checked_before_they_are_opened(tmp_path, capsys, monkeypatch):
    """A FIFO named config.json inside the Hugging Face directory once blocked the read forever."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "config.json")
    _refused(lambda: _script("hf_config")([str(tmp_path)]), tmp_path, "checkpoints.init_from_hf", capsys)


def test_a_recursive_glob_from_the_root_is_bounded(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(lambda: _cli([TINY, "--dry-run", "--set", "data.source=/**/*.parquet"]), tmp_path, "data.source", capsys)


def test_bounded_glob_and_walk(tmp_path):
    """As glob.glob(recursive=True) (which follows links to directories) and os.walk (which does
    not), but regular files only (a FIFO matching the pattern is left out, never opened), no link
    loop walked round, no pseudo file system entered, and a cap on directories listed."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    for rel in ("a/1.txt", "a/b/2.txt", "a/.hidden.txt", "top.txt", "other/3.txt"):
        (tmp_path / rel).write_text("x")
    os.mkfifo(tmp_path / "a" / "pipe.txt")
    os.symlink("..", tmp_path / "a" / "b" / "up")  # a loop for anything that follows links
    os.symlink(tmp_path / "other", tmp_path / "a" / "ext")
    os.symlink("/proc", tmp_path / "a" / "kernel")
    want = sorted(str(tmp_path / r) for r in ("a/1.txt", "a/b/2.txt", "top.txt", "other/3.txt"))
    assert walk_files("data.source", str(tmp_path)) == want
    assert bounded_glob("data.source", f"{tmp_path}/**/*.txt") == sorted(want + [str(tmp_path / "a/ext/3.txt")])
    assert bounded_glob("data.source", f"{tmp_path}/a/*.txt") == [str(tmp_path / "a" / "1.txt")]
    with pytest.raises(PathError, match=r"^data.source: the pattern .* visits more than 2 directories: narrow it$"):
        bounded_glob("data.source", f"{tmp_path}/**/*.txt", max_dirs=2)
    assert MAX_DIRS >= 1000


def test_pseudo_file_systems():
    assert pseudo_fs("/proc/self/status") == "proc"
    assert pseudo_fs("/sys") == "sysfs"
    assert pseudo_fs("/dev/null") is not None
    assert pseudo_fs("/dev/shm") is None and pseudo_fs(str(ROOT)) is None


def test_each_kind_of_wrong_path(tmp_path):
    """path_problem's other answers, one line each, naming the field."""
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "gone", tmp_path / "broken")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s"))
    cases = [
        ("", FILE, "an empty path"),
        ("a\0b", FILE, "NUL byte"),
        (f"{tmp_path}/d", FILE, "is a directory, not a regular file"),
        (f"{tmp_path}/f", DIR, "is a file, not a directory"),
        (f"{tmp_path}/f/sub", CREATE_DIR, "is a file, not a directory"),
        (f"{tmp_path}/broken", FILE, "broken symbolic link"),
        (f"{tmp_path}/broken/x", CREATE_DIR, "broken symbolic link"),
        (f"{tmp_path}/s", FILE, "is a socket, not a regular file"),
        ("/dev/null", FILE, "pseudo file system"),
        (f"{tmp_path}/missing", DIR, "no such file or directory"),
        ("/" + "a/" * 2100, CREATE_DIR, "bytes long"),
    ]
    try:
        for path, expect, fragment in cases:
            line = path_problem("the.field", path, expect)
            assert line and line.startswith("the.field: ") and fragment in line and "\n" not in line, (path, line)
        for path, expect in (
            (f"{tmp_path}/f", FILE),
            (f"{tmp_path}/d", DIR),
            (f"{tmp_path}/d/new/er", CREATE_DIR),
            *([("/dev/shm", CREATE_DIR)] if os.access("/dev/shm", os.W_OK) else []),
        ):
            assert path_problem("the.field", path, expect) is None, path
    finally:
        sock.close()
