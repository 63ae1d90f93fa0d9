"""Issue 17, item 6: data errors that used to surface only inside the ranks (after the run directory
was made and the job queued) are found by `submit.py` from a sample of rows and the total size:
exit 2, one `error:` line naming the file (and line) and the field, nothing written."""

from __future__ import annotations

import json
import os

import pytest

from helpers.cli import run_cli
from helpers.runs import TINY


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet(path, column) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": column}), str(path))


def corrupt_parquet(path) -> None:
    parquet(path, ["z" * 300] * 200)
    data = bytearray(path.read_bytes())
    for i in range(100, 400):  # data pages; the footer (schema, row counts) stays readable
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


TEXT = "t" * 400
# (id, file name, writer of its content, fragments of the one error line)
CASES = [
    (
        "non-string",
        "a.jsonl",
        lambda p: p.write_bytes(jsonl({"text": i} for i in range(400))),
        ["data.text_column", "a.jsonl line 1", "JSON int", "not text"],
    ),
    (
        "mixed",
        "a.jsonl",
        lambda p: p.write_bytes(jsonl([{"text": TEXT}] * 30 + [{"text": [1, 2]}] + [{"text": TEXT}] * 30)),
        ["data.text_column", "a.jsonl line 31", "JSON list"],
    ),
    (
        "not-an-object",
        "a.jsonl",
        lambda p: p.write_bytes(jsonl([{"text": TEXT}] * 30 + [[TEXT]])),
        ["data.source", "a.jsonl line 31", "JSON list, not an object"],
    ),
    (
        "non-json",
        "a.jsonl",
        lambda p: p.write_bytes(jsonl([{"text": TEXT}] * 30) + b"this is not json\n" * 9),
        ["data.source", "a.jsonl line 31 is not JSON"],
    ),
    ("binary", "a.jsonl", lambda p: p.write_bytes(os.urandom(20000) + b"\0"), ["data.source", "binary"]),
    ("latin-1", "a.txt", lambda p: p.write_bytes("caf\xe9 ".encode("latin-1") * 5000), ["data.source", "not UTF-8"]),
    ("empty-lines", "a.jsonl", lambda p: p.write_bytes(b"\n" * 5000), ["data.source", "no documents", "empty lines"]),
    ("corrupt-parquet", "a.parquet", corrupt_parquet, ["data.source", "a.parquet", "corrupt parquet", "'text'"]),
    (
        "int-parquet",
        "a.parquet",
        lambda p: parquet(p, list(range(500))),
        ["data.text_column", "a.parquet", "holds int64"],
    ),
    (
        "too-little",
        "a.jsonl",
        lambda p: p.write_bytes(jsonl([{"text": "hello world"}] * 3)),
        ["too little data for one global batch", "at most", "16 needed", "parallelism.dp=2"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_data_exits_2_before_launch(case, tmp_path, capsys, monkeypatch):
    _, name, write, fragments = case
    monkeypatch.chdir(tmp_path)
    write(tmp_path / name)
    code, out, err = run_cli(
        [TINY, "--local", "--set", f"data.source={tmp_path / name}", "--set", f"logging.dir={tmp_path / 'logs'}"],
        capsys,
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (out, err)
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert not (tmp_path / "logs").exists()  # nothing started, no run directory


def test_good_data_and_what_the_sample_cannot_judge_pass(tmp_path, capsys):
    pretty = tmp_path / "pretty.json"  # one JSON document over many lines: left to the builder
    pretty.write_text(json.dumps([{"text": TEXT}] * 100, indent=2))
    blank_lines = tmp_path / "b.jsonl"  # empty lines between records are fine
    blank_lines.write_bytes(jsonl([{"text": TEXT}] * 100).replace(b"\n", b"\n\n"))
    good = tmp_path / "g.parquet"
    parquet(good, [TEXT] * 100)
    for path in (pretty, blank_lines, good):
        code, _, err = run_cli([TINY, "--dry-run", "--set", f"data.source={path}"], capsys)
        assert code == 0, err
