"""reference_trainer.data: the bundled corpus and its checksums, the tokenizer, the pure micro-batch sampler, the
resume state and the user-data loader's errors."""

from __future__ import annotations

import codecs
import hashlib
import json
import lzma
import shutil
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference_trainer.data import CORPUS_DIR, DOC_SEPARATOR, DOMAINS, DomainBatches, TokenCorpus, load_tokenizer

SEQ, MBS = 64, 3


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def corpus(tokenizer):
    return TokenCorpus.bundled(tokenizer)


@pytest.fixture(scope="module")
def batches(corpus):
    return DomainBatches(corpus, seq_length=SEQ, micro_batch_size=MBS, seed=1234)


def one_line_error(excinfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --- bundled corpus and tokenizer -----------------------------------------------------------------------------------

def test_bundled_corpus_has_the_three_domains(corpus, tokenizer):
    manifest = json.loads((CORPUS_DIR / "manifest.json").read_text())
    assert tuple(corpus.domains) == DOMAINS
    eot = tokenizer.token_to_id("<|endoftext|>")
    for name, ids in corpus.domains.items():
        assert ids.dtype == np.int32 and ids.ndim == 1 and len(ids) > 200_000
        assert ids.min() >= 0 and ids.max() < corpus.vocab_size
        assert int((ids == eot).sum()) == manifest["domains"][name]["documents"] and ids[-1] == eot
        assert not ids.flags.writeable


def test_manifest_checksums_match_the_shipped_files():
    manifest = json.loads((CORPUS_DIR / "manifest.json").read_text())
    for name in DOMAINS:
        entry = manifest["domains"][name]
        blob = (CORPUS_DIR / entry["file"]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == entry["sha256"]
        text = lzma.decompress(blob)
        assert hashlib.sha256(text).hexdigest() == entry["raw_sha256"] and len(text) == entry["raw_bytes"]
        docs = text.decode()[:-1].split(DOC_SEPARATOR)
        assert [hashlib.sha256(d.encode()).hexdigest() for d in docs] == [s["sha256"] for s in entry["sources"]]
        assert all(s["path"] and s["bytes"] > 0 for s in entry["sources"])
        assert 1_000_000 <= entry["raw_bytes"] <= 1_600_000
    total = sum((CORPUS_DIR / f).stat().st_size for f in ("code.txt.xz", "prose.txt.xz", "tables.txt.xz"))
    assert total < 2_000_000
    assert hashlib.sha256((CORPUS_DIR / "tokenizer.json").read_bytes()).hexdigest() == manifest["tokenizer"]["sha256"]


def test_a_corpus_copy_with_one_flipped_byte_is_refused(tmp_path, tokenizer):
    copy = tmp_path / "corpus"
    shutil.copytree(CORPUS_DIR, copy)
    assert tuple(TokenCorpus.bundled(tokenizer, directory=copy).domains) == DOMAINS
    target = copy / "prose.txt.xz"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(ValueError) as excinfo:
        TokenCorpus.bundled(tokenizer, directory=copy)
    one_line_error(excinfo, str(target), "manifest.json")


def test_tokenizer_vocab_and_round_trip(tokenizer, corpus):
    assert tokenizer.get_vocab_size() == 4096 == corpus.vocab_size
    assert tokenizer.token_to_id("<|endoftext|>") == 0 and tokenizer.token_to_id("<|pad|>") == 1
    for text in ["def f(x):\n    return x ** 2  # square\n", "Permission is hereby granted, free of charge.",
                 "date,open,close\n2024-01-02,1.5e3,-0.25\n", "Grüße, naïve café — 東京 ✓\t\f"]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text
        assert len(ids) < len(text.encode())  # BPE actually merges


# --- the sampler ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
@given(step=st.integers(0, 10**9), index=st.integers(0, 10**6))
def test_micro_batch_is_pure_and_targets_shift_by_one(batches, corpus, step, index):
    inputs, targets, domain = batches.micro_batch(step, index)
    again = DomainBatches(corpus, seq_length=SEQ, micro_batch_size=MBS, seed=1234).micro_batch(step, index)
    assert domain == again[2] and np.array_equal(inputs, again[0]) and np.array_equal(targets, again[1])
    assert inputs.shape == targets.shape == (MBS, SEQ) and inputs.dtype == targets.dtype == np.int64
    assert np.array_equal(inputs[:, 1:], targets[:, :-1])
    ids = corpus.domains[domain]
    for row in range(MBS):  # each row is a real window of its domain's stream
        window = np.concatenate([inputs[row], targets[row, -1:]])
        starts = np.flatnonzero(ids[: len(ids) - SEQ] == window[0])
        assert any(np.array_equal(ids[s:s + SEQ + 1], window) for s in starts)


def test_micro_batches_differ_across_index_step_and_seed(batches, corpus):
    base = batches.micro_batch(5, 0)[0]
    assert not np.array_equal(base, batches.micro_batch(5, 1)[0])
    assert not np.array_equal(base, batches.micro_batch(6, 0)[0])
    other = DomainBatches(corpus, seq_length=SEQ, micro_batch_size=MBS, seed=1235)
    assert not np.array_equal(base, other.micro_batch(5, 0)[0])


def test_domains_are_drawn_about_equally_often(batches):
    counts = Counter(batches.micro_batch(step, index)[2] for step in range(30) for index in range(10))
    assert set(counts) == set(DOMAINS)
    assert all(60 <= counts[name] <= 140 for name in DOMAINS), counts  # 300 draws, 100 expected each


def test_state_dict_round_trip_and_mismatches(batches, corpus, tokenizer, tmp_path):
    loader = DomainBatches(corpus, seq_length=SEQ, micro_batch_size=MBS, seed=1234)
    for _ in range(7):
        loader.advance()
    state = json.loads(json.dumps(loader.state_dict()))
    assert state == {"next_step": 7, "seed": 1234, "corpus_sha256": corpus.sha256}
    resumed = DomainBatches(corpus, seq_length=SEQ, micro_batch_size=MBS, seed=1234)
    resumed.load_state_dict(state)
    assert resumed.next_step == 7
    with pytest.raises(ValueError, match="drawn with --seed 1234; this run has --seed 99"):
        DomainBatches(corpus, seq_length=SEQ, micro_batch_size=MBS, seed=99).load_state_dict(state)
    (tmp_path / "mine.txt").write_text("hello world " * 100)
    small = TokenCorpus.from_path(str(tmp_path / "mine.txt"), tokenizer)
    with pytest.raises(ValueError, match="--data: the checkpoint was trained on another corpus"):
        DomainBatches(small, seq_length=8, micro_batch_size=1, seed=1234).load_state_dict(state)


def test_invalid_sampler_arguments(corpus, batches):
    with pytest.raises(ValueError, match="seq_length"):
        DomainBatches(corpus, seq_length=0, micro_batch_size=1, seed=0)
    with pytest.raises(ValueError, match="seed"):
        DomainBatches(corpus, seq_length=8, micro_batch_size=1, seed=-1)
    with pytest.raises(ValueError, match="step"):
        batches.micro_batch(-1, 0)


# --- the user's data ------------------------------------------------------------------------------------------------

def test_from_path_txt_jsonl_and_directory(tmp_path, tokenizer):
    (tmp_path / "code.txt").write_text("def f():\n    return 1\n" * 20 + DOC_SEPARATOR + "x = 2\n" * 20)
    (tmp_path / "more.jsonl").write_text(
        json.dumps({"text": "The quick brown fox. " * 20, "domain": "prose"}) + "\n\n"
        + json.dumps({"text": "no domain here " * 20}) + "\n" + json.dumps({"text": "a,b\n1,2\n" * 20}) + "\n")
    (tmp_path / "notes.md").write_text("ignored")
    txt = TokenCorpus.from_path(str(tmp_path / "code.txt"), tokenizer)
    assert list(txt.domains) == ["code"] and int((txt.domains["code"] == 0).sum()) == 2
    jsonl = TokenCorpus.from_path(str(tmp_path / "more.jsonl"), tokenizer)
    assert list(jsonl.domains) == ["default", "prose"] and int((jsonl.domains["default"] == 0).sum()) == 2
    both = TokenCorpus.from_path(str(tmp_path), tokenizer)
    assert list(both.domains) == ["code", "default", "prose"] and both.vocab_size == 4096
    text = tokenizer.decode(both.domains["prose"].tolist())
    assert text.startswith("The quick brown fox.")
    inputs, targets, domain = DomainBatches(both, seq_length=16, micro_batch_size=2, seed=0).micro_batch(0, 0)
    assert inputs.shape == (2, 16) and domain in both.domains


@pytest.mark.parametrize("case, fragment", [
    ("missing", "no such file or directory"),
    ("wrong_extension", "unsupported file type '.csv'"),
    ("empty_txt", "empty data"),
    ("empty_jsonl", "empty data"),
    ("bad_json", "line 2: invalid JSON"),
    ("not_an_object", 'line 1: expected an object with a string "text"'),
    ("empty_dir", "no .txt or .jsonl files"),
    ("nested", "line 1: JSON nested too deeply"),
    ("surrogate", "line 1: \"text\" or \"domain\" holds a lone surrogate"),
    ("long_name", "File name too long"),
])
def test_from_path_errors_are_one_line_and_name_the_path(tmp_path, tokenizer, case, fragment):
    path = {"missing": tmp_path / "nope.txt", "wrong_extension": tmp_path / "data.csv",
            "empty_txt": tmp_path / "e.txt", "empty_jsonl": tmp_path / "e.jsonl", "bad_json": tmp_path / "b.jsonl",
            "not_an_object": tmp_path / "n.jsonl", "empty_dir": tmp_path / "dir", "nested": tmp_path / "d.jsonl",
            "surrogate": tmp_path / "s.jsonl", "long_name": tmp_path / ("a" * 300 + ".txt")}[case]
    content = {"wrong_extension": "a,b\n", "empty_txt": " \n\n", "empty_jsonl": "\n", "not_an_object": "[1, 2]\n",
               "bad_json": json.dumps({"text": "fine"}) + "\n{not json\n", "nested": "[" * 200_000 + "\n",
               "surrogate": '{"text": "a \\ud800 b"}\n'}
    if case == "empty_dir":
        path.mkdir()
        (path / "readme.md").write_text("not data")
    elif case in content:
        path.write_text(content[case])
    with pytest.raises(ValueError) as excinfo:
        TokenCorpus.from_path(str(path), tokenizer)
    one_line_error(excinfo, str(path)[:100], fragment)


def test_json_lines_end_at_newlines_only(tmp_path, tokenizer):
    """U+2028 and U+0085 are text inside a JSON string (json.dumps(..., ensure_ascii=False) writes them raw)."""
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps({"text": "one\u2028two\u0085three " * 40}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    corpus = TokenCorpus.from_path(str(path), tokenizer)
    assert list(corpus.domains) == ["default"]


def test_a_byte_order_mark_is_not_trained_on(tmp_path, tokenizer):
    """A file an editor saved with a UTF-8 byte order mark reads as the same file without it (.txt and .jsonl)."""
    text = "the quick brown fox jumps over the lazy dog " * 20
    for suffix, content in ((".txt", text), (".jsonl", json.dumps({"text": text}) + "\n")):
        plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
        plain.write_text(content, encoding="utf-8")
        marked.write_text(content, encoding="utf-8-sig")
        assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
        ids = [TokenCorpus.from_path(str(path), tokenizer).domains for path in (plain, marked)]
        assert [list(domain) for domain in ids[0].values()] == [list(domain) for domain in ids[1].values()]


def test_data_file_suffixes_are_read_in_any_case(tmp_path, tokenizer):
    text = "the quick brown fox jumps over the lazy dog " * 20
    (tmp_path / "LOUD.TXT").write_text(text)
    (tmp_path / "Mixed.JsonL").write_text(json.dumps({"text": text, "domain": "mixed"}) + "\n")
    corpus = TokenCorpus.from_path(str(tmp_path), tokenizer)
    assert sorted(corpus.domains) == ["LOUD", "mixed"]
    assert list(TokenCorpus.from_path(str(tmp_path / "LOUD.TXT"), tokenizer).domains) == ["LOUD"]


def test_a_domain_shorter_than_one_sequence_is_refused(tmp_path, tokenizer):
    (tmp_path / "tiny.txt").write_text("just a few words")
    small = TokenCorpus.from_path(str(tmp_path / "tiny.txt"), tokenizer)
    with pytest.raises(ValueError) as excinfo:
        DomainBatches(small, seq_length=128, micro_batch_size=1, seed=0)
    one_line_error(excinfo, str(tmp_path / "tiny.txt"), "'tiny'", "fewer than one sequence")


@pytest.mark.parametrize("case, fragment", [
    ("binary_txt", "binary data (a NUL byte at offset"),
    ("binary_jsonl", "binary data (a NUL byte at offset"),
    ("latin1_txt", "not UTF-8 text (byte 0xe9 at offset 3"),
    ("marked_latin1_txt", "not UTF-8 text (byte 0xe9 at offset 6"),  # counted from the file's first byte
    ("latin1_jsonl", "not UTF-8 text (byte 0xe9"),
    ("long_txt", "document 1 is 9437185 bytes, over the 8 MiB limit"),
    ("long_jsonl", "line 2 is 9437196 bytes, over the 8 MiB limit"),
])
def test_binary_other_encodings_and_huge_documents_are_refused(tmp_path, tokenizer, case, fragment):
    suffix = ".jsonl" if case.endswith("jsonl") else ".txt"
    path = tmp_path / f"data{suffix}"
    if case.startswith("binary"):
        path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    elif case == "latin1_txt":
        path.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    elif case == "marked_latin1_txt":
        path.write_bytes(codecs.BOM_UTF8 + "caf\u00e9 au lait\n".encode("latin-1"))
    elif case == "latin1_jsonl":
        path.write_bytes(('{"text": "caf\u00e9"}\n').encode("latin-1"))
    elif case == "long_txt":
        path.write_text("x" * (9 << 20) + "\n")
    else:
        path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "y" * (9 << 20)}) + "\n")
    with pytest.raises(ValueError) as excinfo:
        TokenCorpus.from_path(str(path), tokenizer)
    one_line_error(excinfo, str(path), fragment)


def test_the_trainer_refuses_bad_data_in_one_line_before_any_collective(tmp_path, capsys, monkeypatch):
    from reference_trainer import train

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "weights.txt"
    path.write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)))
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--pp", "1", "--dp", "1", "--ep", "1", "--steps", "1", "--data", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert err[0].startswith(f"error: --data: {path}: binary data")


@pytest.mark.slow
def test_the_token_cache_is_reused_and_a_damaged_one_is_rebuilt(tmp_path, tokenizer, monkeypatch):
    from reference_trainer import data

    monkeypatch.setenv("BAGUALU2_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(data, "_MEMO", {})
    first = TokenCorpus.bundled(tokenizer)
    (cached,) = tmp_path.glob("corpus-*.npz")
    monkeypatch.setattr(data, "_MEMO", {})
    monkeypatch.setattr(data, "_encode", lambda *a: pytest.fail("the cache was not used"))
    assert TokenCorpus.bundled(tokenizer).sha256 == first.sha256
    cached.write_bytes(cached.read_bytes()[:-100])  # truncated: refused, rebuilt
    monkeypatch.undo()
    monkeypatch.setenv("BAGUALU2_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(data, "_MEMO", {})
    assert TokenCorpus.bundled(tokenizer).sha256 == first.sha256
    assert data._load_cached(next(iter(data._MEMO))) is not None  # rewritten intact


@pytest.mark.slow
def test_a_token_cache_path_that_is_not_a_regular_file_is_left_alone(tmp_path, tokenizer, monkeypatch):
    """A FIFO (or a folder) where the cache file goes: not read (a FIFO would block the start-up forever), not
    replaced; the corpus is tokenized as without a cache."""
    import os
    import threading

    from reference_trainer import data

    monkeypatch.setenv("BAGUALU2_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(data, "_MEMO", {})
    first = TokenCorpus.bundled(tokenizer)
    (cached,) = tmp_path.glob("corpus-*.npz")
    cached.unlink()
    os.mkfifo(cached)
    monkeypatch.setattr(data, "_MEMO", {})
    loaded = []
    worker = threading.Thread(target=lambda: loaded.append(TokenCorpus.bundled(tokenizer)), daemon=True)
    worker.start()
    worker.join(120)
    if worker.is_alive():  # unblock the reader before failing
        os.close(os.open(cached, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("loading the corpus blocked on the FIFO at the cache path")
    assert loaded[0].sha256 == first.sha256 and cached.is_fifo()
