"""The data pipeline (nanotrain.data): sources, tokenizers, packing, sampling, cache, errors.

Everything runs in-process on small files made in tmp_path or on a slice of the Python standard
library; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import numpy as np
import pytest
import torch

from nanotrain.config.schema import Config, DataArgs
from nanotrain.data import (
    ByteTokenizer,
    DataError,
    GlobalSampler,
    TokenDataset,
    build_sampler,
    check_data_config,
    prepare_dataset,
    resolve_source,
    stdlib_files,
)
from nanotrain.data import dataset as dataset_mod

DOCS = [
    "hello world\nsecond line",
    "",
    "naïve café ☕ — ünïcödé",
    "def f(x):\n    return x + 1\n",
    "the quick brown fox jumps over the lazy dog " * 3,
]


def byte_stream(docs) -> list[int]:
    """What the byte tokenizer should produce: each non-empty doc's bytes, then separator 0."""
    out = []
    for d in docs:
        if d:
            out += list(d.encode("utf-8")) + [0]
    return out


def build(tmp_path, source, seq_len=8, **kw) -> TokenDataset:
    args = DataArgs(
        source=str(source), **{k: kw.pop(k) for k in list(kw) if k in ("text_column", "tokenizer", "num_workers")}
    )
    kw.setdefault("vocab_size", 256)
    return TokenDataset.build(args, seq_len=seq_len, cache_dir=str(tmp_path / "cache"), **kw)


def write_jsonl(path, docs, column="text"):
    path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def stdlib_ds(tmp_path_factory) -> TokenDataset:
    """The first 40 stdlib files, tokenised once for the sampler tests (about 0.3 M tokens)."""
    cache = tmp_path_factory.mktemp("stdlib_cache")
    return TokenDataset.build(
        DataArgs(source="stdlib"), seq_len=16, cache_dir=str(cache), vocab_size=256, max_documents=40
    )


# ---- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café ☕ — \x01 tabs\tand\nnewlines"
    (ids,) = tok.encode_batch([text])
    assert ids.max() < tok.vocab_size == 256 and tok.separator_id == 0
    assert tok.decode(ids) == text


def _train_bpe(path, vocab_size=300):
    import tokenizers  # a dev dependency (tests only: the product never needs it to train)
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["[UNK]", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([d for d in DOCS if d] * 20, trainer=trainer)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return tok


def test_tokenizer_json_path(tmp_path):
    hf = _train_bpe(tmp_path / "tokenizer.json")
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    ds = build(tmp_path, src, seq_len=4, tokenizer=str(tmp_path / "tokenizer.json"), vocab_size=512)
    sep = hf.token_to_id("<|endoftext|>")
    assert ds.separator_id == sep and ds.tokenizer_vocab_size == hf.get_vocab_size()
    expected = []
    for d in DOCS:
        if d:
            expected += hf.encode(d, add_special_tokens=False).ids + [sep]
    assert ds.tokens.tolist() == expected
    # Each document decodes back to its text.
    pieces = np.split(np.asarray(ds.tokens), np.flatnonzero(np.asarray(ds.tokens) == sep) + 1)
    assert [hf.decode(p[:-1].tolist()) for p in pieces if len(p)] == [d for d in DOCS if d]


def test_tokenizer_vocab_larger_than_model(tmp_path):
    _train_bpe(tmp_path / "tok.json", vocab_size=300)
    args = DataArgs(source=str(write_jsonl(tmp_path / "d.jsonl", DOCS)), tokenizer=str(tmp_path / "tok.json"))
    with pytest.raises(
        DataError,
        match=r"model.vocab_size=256 is smaller than the vocabulary of "
        r"data.tokenizer=.*set model.vocab_size >= 3\d\d",
    ):
        check_data_config(args, vocab_size=256)
    with pytest.raises(DataError, match="model.vocab_size=256"):
        TokenDataset.build(args, seq_len=4, cache_dir=str(tmp_path / "c"), vocab_size=256)


def test_tokenizer_errors(tmp_path, monkeypatch):
    src = str(write_jsonl(tmp_path / "d.jsonl", DOCS))
    with pytest.raises(DataError, match=r"data.tokenizer: no such file .*nope.json.*'byte'"):
        check_data_config(DataArgs(source=src, tokenizer=str(tmp_path / "nope.json")))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="data.tokenizer: cannot load"):
        check_data_config(DataArgs(source=src, tokenizer=str(tmp_path / "bad.json")))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(DataError, match="needs the optional `tokenizers` package; pip install"):
        check_data_config(DataArgs(source=src, tokenizer=str(tmp_path / "bad.json")))


# ---- sources ----------------------------------------------------------------------------------


def test_jsonl_source(tmp_path):
    ds = build(tmp_path, write_jsonl(tmp_path / "d.jsonl", DOCS))
    assert ds.tokens.tolist() == byte_stream(DOCS)
    assert ds.num_documents == 4 and ds.tokens.dtype == np.uint16  # the empty doc adds nothing


def test_json_array_and_csv_sources(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": d} for d in DOCS]))
    assert build(tmp_path, tmp_path / "a.json").tokens.tolist() == byte_stream(DOCS)
    import csv

    with open(tmp_path / "b.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["body", "n"])
        w.writerows([[d, i] for i, d in enumerate(DOCS) if d])
    ds = build(tmp_path, tmp_path / "b.csv", text_column="body")
    assert ds.tokens.tolist() == byte_stream(DOCS)


def test_txt_source_one_document_per_file(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    ds = build(tmp_path, tmp_path / "a.txt")
    assert ds.tokens.tolist() == byte_stream(DOCS[:1])  # newlines kept: the file is one doc


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "d.parquet")
    ds = build(tmp_path, tmp_path / "d.parquet", text_column="content")
    assert ds.tokens.tolist() == byte_stream(DOCS)


def test_directory_and_glob_sources(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    write_jsonl(data / "b.jsonl", DOCS[2:])
    write_jsonl(data / "a.jsonl", DOCS[:2])
    write_jsonl(data / "sub" / "c.jsonl", ["in a subfolder"])
    (data / "README").write_text("ignored: not a data extension")
    (data / ".hidden.jsonl").write_text("ignored: hidden\n")
    everything = DOCS + ["in a subfolder"]  # sorted by path: a, b, sub/c
    assert build(tmp_path, data).tokens.tolist() == byte_stream(everything)
    assert build(tmp_path, f"{data}/").tokens.tolist() == byte_stream(everything)
    assert build(tmp_path, f"{data}/*.jsonl").tokens.tolist() == byte_stream(DOCS)
    assert build(tmp_path, f"{data}/**/*.jsonl").tokens.tolist() == byte_stream(everything)


def test_stdlib_source(tmp_path):
    files = stdlib_files()
    assert len(files) > 300 and list(files) == sorted(files)
    assert not any(os.sep + d + os.sep in f for f in files for d in ("site-packages", "test"))
    ds = build(tmp_path, "stdlib", seq_len=64, max_documents=30)
    assert 20 <= ds.num_documents <= 30 and ds.num_tokens > 10_000
    assert ds.meta["kind"] == "stdlib"
    text = ByteTokenizer().decode(ds.tokens[:2000])
    assert "import" in text or "def " in text or '"""' in text


def test_hub_names_are_not_paths():
    assert resolve_source("wikitext").kind == "hub"
    src = resolve_source("Salesforce/wikitext:wikitext-2-raw-v1")
    assert (src.kind, src.hub_name, src.hub_config) == ("hub", "Salesforce/wikitext", "wikitext-2-raw-v1")


# ---- packing ----------------------------------------------------------------------------------


def test_packing_windows_and_shifted_targets(tmp_path):
    ds = build(tmp_path, write_jsonl(tmp_path / "d.jsonl", DOCS), seq_len=8)
    stream = byte_stream(DOCS)
    assert ds.num_windows == (len(stream) - 1) // 8
    w = ds.windows(range(ds.num_windows))
    assert w.shape == (ds.num_windows, 9) and w.dtype == np.int64
    for i in range(ds.num_windows):
        assert w[i].tolist() == stream[i * 8 : i * 8 + 9]
    # Every token after the first is a target exactly once.
    assert np.concatenate([x[1:] for x in w]).tolist() == stream[1 : ds.num_windows * 8 + 1]

    sampler = GlobalSampler(ds, seed=0, dp=1, micro_batch_size=3, batch_accumulation=2)
    for ids, targets in sampler.batch_for_step(0, 0):
        assert ids.shape == targets.shape == (3, 8) and ids.dtype == targets.dtype == torch.int64
        assert torch.equal(ids[:, 1:], targets[:, :-1])


def test_sequence_length_change_reuses_cache(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    a, b = build(tmp_path, src, seq_len=8), build(tmp_path, src, seq_len=5)
    assert b.from_cache and a.path == b.path and b.num_windows == (a.num_tokens - 1) // 5


# ---- sampling ---------------------------------------------------------------------------------


def _step(sampler, step, consumed=None):
    """All of a step's samples in global order: dp ranks, then micro-batches, then rows."""
    consumed = sampler.consumed_samples(step) if consumed is None else consumed
    ids = [mb[0] for d in range(sampler.dp) for mb in sampler.batch(consumed, d)]
    tgt = [mb[1] for d in range(sampler.dp) for mb in sampler.batch(consumed, d)]
    return torch.cat(ids), torch.cat(tgt)


def test_determinism(stdlib_ds):
    a = GlobalSampler(stdlib_ds, seed=7, dp=2, micro_batch_size=2, batch_accumulation=2)
    b = GlobalSampler(stdlib_ds, seed=7, dp=2, micro_batch_size=2, batch_accumulation=2)
    c = GlobalSampler(stdlib_ds, seed=8, dp=2, micro_batch_size=2, batch_accumulation=2)
    for s in range(3):
        assert all(torch.equal(x, y) for x, y in zip(_step(a, s), _step(b, s)))
        assert not torch.equal(_step(a, s)[0], _step(c, s)[0])


def test_dp_splits_read_the_same_global_samples(stdlib_ds):
    shapes = [(1, 4, 2), (2, 2, 2), (4, 1, 2), (2, 4, 1), (4, 2, 1)]  # (dp, m, mbs), G = 8
    samplers = [
        GlobalSampler(stdlib_ds, seed=3, dp=dp, micro_batch_size=mbs, batch_accumulation=m) for dp, m, mbs in shapes
    ]
    for step in (0, 1, 5):
        ref = _step(samplers[0], step)
        for s in samplers[1:]:
            assert all(torch.equal(x, y) for x, y in zip(ref, _step(s, step)))
    # dp rank d reads the contiguous block [s*G + d*m*mbs, ...) of the global stream.
    s = samplers[1]
    ids, _ = s.batch(s.consumed_samples(3), 1)[1]
    want = s.samples(3 * 8 + 1 * 4 + 1 * 2, 2)
    assert torch.equal(ids, torch.from_numpy(want[:, :-1]))


def test_restore_from_consumed_samples(stdlib_ds):
    run = GlobalSampler(stdlib_ds, seed=11, dp=2, micro_batch_size=2, batch_accumulation=2)
    uninterrupted = [_step(run, s) for s in range(8)]
    consumed = run.consumed_samples(5)
    # A restarted process: a fresh sampler, same topology, positioned by the consumed count.
    again = GlobalSampler(stdlib_ds, seed=11, dp=2, micro_batch_size=2, batch_accumulation=2)
    for i, s in enumerate(range(5, 8)):
        got = _step(again, 0, consumed=consumed + i * again.global_batch_size)
        assert all(torch.equal(x, y) for x, y in zip(got, uninterrupted[s]))
    # Restarted at another dp with the same global batch: the same samples, split differently.
    other = GlobalSampler(stdlib_ds, seed=11, dp=4, micro_batch_size=1, batch_accumulation=2)
    assert all(torch.equal(x, y) for x, y in zip(_step(other, 0, consumed=consumed), uninterrupted[5]))


def test_epoch_wrap_reshuffles(tmp_path):
    ds = build(tmp_path, write_jsonl(tmp_path / "d.jsonl", DOCS), seq_len=4)
    W = ds.num_windows
    s = GlobalSampler(ds, seed=5, dp=1, micro_batch_size=3, batch_accumulation=1)
    first, second = s.window_indices(0, W), s.window_indices(W, W)
    assert sorted(first) == sorted(second) == list(range(W))  # each epoch: every window once
    assert not np.array_equal(first, second)  # in a new order (seed, epoch)
    # A step straddling the epoch boundary takes the end of one and the start of the next.
    straddle = s.window_indices(W - 2, 5)
    assert straddle.tolist() == first[-2:].tolist() + second[:3].tolist()
    assert s.epoch_of(W - 1) == 0 and s.epoch_of(W) == 1
    # Stepping far past the data keeps working.
    assert len(s.batch_for_step(10 * W, 0)) == 1


# ---- cache ------------------------------------------------------------------------------------


def test_cache_reuse_does_not_retokenise(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = build(tmp_path, src)
    assert not first.from_cache
    assert sorted(os.listdir(first.path)) == ["meta.json", "tokens.bin"]
    assert os.path.dirname(first.path) == str(tmp_path / "cache")

    def no_tokenising(*a, **k):
        raise AssertionError("re-tokenised despite a cache")

    monkeypatch.setattr(dataset_mod, "_tokenise", no_tokenising)
    second = build(tmp_path, src)
    assert second.from_cache and second.path == first.path
    assert np.array_equal(first.tokens, second.tokens)
    monkeypatch.undo()
    # A changed file is a new cache entry, not stale tokens.
    write_jsonl(src, DOCS + ["one more document"])
    third = build(tmp_path, src)
    assert not third.from_cache and third.path != first.path


def test_num_workers_gives_the_same_tokens(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS * 10)
    one = build(tmp_path / "one", src)
    two = build(tmp_path / "two", src, num_workers=2)
    assert not two.from_cache and np.array_equal(one.tokens, two.tokens)


def test_one_rank_builds_the_others_load(tmp_path):
    args = DataArgs(source=str(write_jsonl(tmp_path / "d.jsonl", DOCS)))
    barrier = threading.Barrier(3, timeout=60)
    results: dict = {}

    def rank(r):
        results[r] = prepare_dataset(
            args,
            seq_len=4,
            cache_dir=str(tmp_path / "cache"),
            vocab_size=256,
            builder=r == 0,
            needs_data=r != 2,
            barrier=barrier.wait,
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not results[0].from_cache and results[1].from_cache and results[2] is None
    assert np.array_equal(results[0].tokens, results[1].tokens)


def test_builder_failure_does_not_hang_the_others(tmp_path):
    args = DataArgs(source=str(tmp_path / "missing.jsonl"))
    calls = []
    with pytest.raises(DataError, match="no such file"):
        prepare_dataset(args, seq_len=4, cache_dir=str(tmp_path), builder=True, barrier=lambda: calls.append("builder"))
    with pytest.raises(DataError, match="tokenised cache .* is missing"):
        prepare_dataset(
            DataArgs(source=str(write_jsonl(tmp_path / "d.jsonl", DOCS))),
            seq_len=4,
            cache_dir=str(tmp_path),
            builder=False,
            barrier=lambda: calls.append("other"),
        )
    assert calls == ["builder", "other"]


def test_build_sampler_from_config(tmp_path):
    cfg = Config()
    cfg.logging.dir = str(tmp_path / "logs")
    cfg.training.sequence_length, cfg.training.micro_batch_size = 32, 2
    cfg.training.batch_accumulation_per_replica, cfg.parallelism.dp = 3, 2
    sampler = build_sampler(cfg, max_documents=5)
    assert sampler.dataset.path.startswith(str(tmp_path / "logs" / ".cache" / "data"))
    assert sampler.global_batch_size == 12
    mbs = sampler.batch_for_step(0, 1)
    assert len(mbs) == 3 and mbs[0][0].shape == (2, 32)


# ---- errors -----------------------------------------------------------------------------------


def _errors(tmp_path, args, match, *, seq_len=8, check=True):
    """The error from the pre-submit check (when it can see it) and from the real build."""
    if check:
        before = sorted(tmp_path.rglob("*"))
        with pytest.raises(DataError, match=match):
            check_data_config(args)
        assert sorted(tmp_path.rglob("*")) == before  # the check writes (tokenises) nothing
    with pytest.raises(DataError, match=match) as info:
        TokenDataset.build(args, seq_len=seq_len, cache_dir=str(tmp_path / "cache"), vocab_size=256)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_error_missing_path(tmp_path):
    _errors(
        tmp_path,
        DataArgs(source=str(tmp_path / "nope.jsonl")),
        r"data.source: no such file or directory .*nope.jsonl.*point data.source at",
    )
    _errors(tmp_path, DataArgs(source=str(tmp_path / "nope")), "no such file or directory")
    _errors(tmp_path, DataArgs(source=str(tmp_path / "*.parquet")), r"data.source: the glob .* matches no files")
    (tmp_path / "empty_dir").mkdir()
    _errors(tmp_path, DataArgs(source=str(tmp_path / "empty_dir")), r"directory .* holds no")


def test_error_mixed_kinds(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    (tmp_path / "b.txt").write_text("x")
    _errors(tmp_path, DataArgs(source=str(tmp_path)), r"mixes file kinds \(json, text\)")


def test_error_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    _errors(
        tmp_path,
        DataArgs(source=str(tmp_path / "empty.jsonl")),
        r"data.source: .*empty.jsonl' is empty \(1 file\(s\), all 0 bytes\)",
    )
    write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    _errors(
        tmp_path,
        DataArgs(source=str(tmp_path / "blank.jsonl")),
        r"has 2 documents but every 'text' is empty",
        check=False,
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    _errors(tmp_path, DataArgs(source=str(tmp_path / "none.parquet")), r"has no documents \(0 rows\)", check=False)


def test_error_missing_text_column(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS, column="content")
    msg = _errors(
        tmp_path,
        DataArgs(source=str(src)),
        r"data.text_column: 'text' is not a column of .*columns present: \['content', 'id'\]",
    )
    assert "set data.text_column" in msg
    _errors(tmp_path, DataArgs(source="stdlib", text_column="body"), r"columns present: \['path', 'text'\]")
    _errors(tmp_path, DataArgs(source=str(src), text_column="id"), r"column 'id' .* not text", check=False)


def test_error_too_little_data(tmp_path):
    ds = build(tmp_path, write_jsonl(tmp_path / "d.jsonl", DOCS[:1]), seq_len=8)
    assert ds.num_windows == 2
    with pytest.raises(
        DataError,
        match=r"too little data for one global batch: 2 windows of "
        r"training.sequence_length\+1=9 tokens exist .* 8 needed "
        r"\(parallelism.dp=2 x .*=2 x .*micro_batch_size=2\)",
    ):
        GlobalSampler(ds, seed=0, dp=2, micro_batch_size=2, batch_accumulation=2)


def test_check_accepts_good_configs(tmp_path):
    assert check_data_config(DataArgs()).kind == "stdlib"
    assert check_data_config(DataArgs(source="some-org/some-dataset")).kind == "hub"
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    assert check_data_config(DataArgs(source=str(src)), vocab_size=256).files == (str(src),)
    assert not (tmp_path / "cache").exists()
