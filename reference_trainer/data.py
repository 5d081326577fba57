"""The reference trainer's data: a bundled mixed-domain corpus, its BPE tokenizer and a pure, resumable loader.

Bundled corpus (``reference_trainer/corpus/``, built offline by ``scripts/build_corpus.py``; sources, licences and
checksums in ``manifest.json``): three domains of about 1.25 MB of real text each -- ``code`` (Python standard
library), ``prose`` (licence texts, package descriptions, READMEs, release notes) and ``tables`` (CSV/TSV/.dat
tables) -- stored as ``<domain>.txt.xz``, documents separated by a line holding only ``\\x1e``. The tokenizer is a
byte-level BPE (Hugging Face ``tokenizers``), vocab 4096, special tokens ``<|endoftext|>`` (0) and ``<|pad|>`` (1);
the corpus is about 1.3 M tokens (0.37 M code, 0.40 M prose, 0.53 M tables).

Cost: checking, decompressing and tokenizing the bundled corpus took 0.8-1.2 s (measured, cold process) on a 2-core
CPU box: ``encode_batch_fast`` over up to 8 Python threads (the Rust side releases the GIL), about 0.5 s per MB per
core, so less with more cores (single-threaded it is about 1.5-2 s). The token ids are memoised
per process and cached on disk (:func:`cache_dir`, one ``.npz`` written atomically, with a sha256 of the ids that
is checked on load), both keyed by the archives' and the tokenizer's sha256, so later processes and calls cost only
the checksum checks (tens of ms). ``TOKENIZERS_PARALLELISM`` defaults to ``false`` here (no Rust thread pool
before torchrun forks); the helper threads are joined before returning.

Sampling (:class:`DomainBatches`): micro-batch ``index`` of iteration ``step`` is a pure function of
``(seed, step, index)`` -- ``numpy.random.default_rng([seed, step, index])`` picks ONE domain with equal
probability (``1 / number of domains``; domains in sorted order) and then ``micro_batch_size`` uniformly random
windows of ``seq_length + 1`` consecutive tokens of that domain (documents joined with ``<|endoftext|>``).
Every rank and every parallel layout therefore sees the same data for the same ``(step, index)``, and a resumed
run continues exactly; the loader's only state is ``next_step``.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import lzma
import os
import stat
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402

DOMAINS = ("code", "prose", "tables")
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
DOC_SEPARATOR = "\n\x1e\n"
DATA_SUFFIXES = (".txt", ".jsonl")  # the files a --data path or folder is read from
EOT, PAD = "<|endoftext|>", "<|pad|>"
_ALLOWED = "expected a .txt file, a .jsonl file or a directory of them"
MAX_DOCUMENT_BYTES = 8 << 20  # one document (a .txt document, a .jsonl line): larger ones are refused
_MEMO: dict[tuple[str, str], dict[str, np.ndarray]] = {}


def load_tokenizer(path: str | None = None) -> tokenizers.Tokenizer:
    """The tokenizer saved at ``path`` (``tokenizer.json`` format); the bundled byte-level BPE by default."""
    file = Path(path) if path is not None else CORPUS_DIR / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"{file}: no such tokenizer file (expected a Hugging Face tokenizer.json)")
    if path is None:  # the bundled one must be the one the manifest lists
        expected = json.loads((CORPUS_DIR / "manifest.json").read_text())["tokenizer"].get("sha256")
        if expected and _sha256(file.read_bytes()) != expected:
            raise ValueError(f"{file}: sha256 does not match {CORPUS_DIR / 'manifest.json'} (a damaged install)")
    return tokenizers.Tokenizer.from_file(str(file))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _encode(tokenizer: tokenizers.Tokenizer, docs: Sequence[str]) -> np.ndarray:
    """Token ids of ``docs``, each followed by ``<|endoftext|>``, as one int32 array."""
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"the tokenizer has no {EOT!r} token (needed to join documents)")
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    workers = max(1, min(8, os.cpu_count() or 1, len(docs)))
    chunks = [list(docs[i::workers]) for i in range(workers)]  # interleaved: balanced chunk sizes
    with ThreadPoolExecutor(workers) as pool:
        encoded = list(pool.map(lambda chunk: encode(chunk, add_special_tokens=False), chunks))
    per_doc: list[list[int]] = [[] for _ in docs]
    for worker, chunk in enumerate(encoded):
        for position, encoding in zip(range(worker, len(docs), workers), chunk):
            per_doc[position] = encoding.ids + [eot]
    total = sum(len(ids) for ids in per_doc)
    return np.fromiter(itertools.chain.from_iterable(per_doc), dtype=np.int32, count=total)


class TokenCorpus:
    """Token ids per domain (1-D int32 arrays; each document is followed by ``<|endoftext|>``)."""

    def __init__(self, domains: dict[str, np.ndarray], vocab_size: int, source: str = "<memory>") -> None:
        if not domains:
            raise ValueError(f"{source}: no domains")
        self.domains: dict[str, np.ndarray] = {}
        for name, ids in sorted(domains.items()):
            view = np.asarray(ids, dtype=np.int32).view()  # a read-only view: shared safely, caller's array intact
            if view.ndim != 1:
                raise ValueError(f"{source}: domain {name!r} token ids must be 1-D, got shape {view.shape}")
            view.setflags(write=False)
            self.domains[name] = view
        self._vocab_size = int(vocab_size)
        self.source = source
        self._sha: str | None = None

    @classmethod
    def bundled(cls, tokenizer: tokenizers.Tokenizer, directory: str | os.PathLike[str] | None = None) -> TokenCorpus:
        """The bundled corpus (or a copy of it in ``directory``), each ``.xz`` checked against ``manifest.json``."""
        base = Path(directory) if directory is not None else CORPUS_DIR
        manifest_file = base / "manifest.json"
        if not manifest_file.is_file():
            raise ValueError(f"{manifest_file}: missing corpus manifest")
        manifest = json.loads(manifest_file.read_text())
        blobs: dict[str, bytes] = {}
        for name in DOMAINS:
            entry = manifest["domains"][name]
            file = base / entry["file"]
            blob = file.read_bytes() if file.is_file() else b""
            if _sha256(blob) != entry["sha256"]:
                raise ValueError(f"{file}: sha256 does not match manifest.json ({entry['sha256'][:12]}...); "
                                 "the corpus is corrupt or was modified -- rebuild with scripts/build_corpus.py")
            blobs[name] = blob
        key = ("".join(manifest["domains"][n]["sha256"] for n in DOMAINS), _sha256(tokenizer.to_str().encode()))
        if key not in _MEMO:
            _MEMO[key] = _load_cached(key) or _store_cached(key, {
                name: _encode(tokenizer, lzma.decompress(blob).decode("utf-8")[:-1].split(DOC_SEPARATOR))
                for name, blob in blobs.items()})
        return cls(_MEMO[key], tokenizer.get_vocab_size(with_added_tokens=True), source=str(base))

    @classmethod
    def from_path(cls, path: str, tokenizer: tokenizers.Tokenizer) -> TokenCorpus:
        """The user's data at ``path``: a ``.txt`` file (one domain named after the file stem; documents separated
        by lines holding only ``\\x1e``), a ``.jsonl`` file (one object per line with a string ``"text"`` and an
        optional string ``"domain"``, default ``"default"``) or a directory of such files (not recursive)."""
        root = Path(path)
        try:
            os.lstat(root)
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file or directory ({_ALLOWED})") from None
        except OSError as exc:  # a name too long, a component that is not a folder, ...
            raise ValueError(f"{str(path)[:120]}: {exc.strerror or exc} ({_ALLOWED})") from None
        if not root.exists():
            raise ValueError(f"{path}: no such file or directory ({_ALLOWED})")
        if root.is_dir():
            files = data_files(root)
            odd = next((p for p in files if not p.is_file()), None)
            if odd is not None:  # a dangling link, a device, a pipe or a folder named like a data file
                raise ValueError(f"{odd}: not a regular file ({_ALLOWED}); remove it from {path} or make it one")
            if not files:
                raise ValueError(f"{path}: no .txt or .jsonl files in this directory ({_ALLOWED})")
        elif root.suffix.lower() in DATA_SUFFIXES:
            files = [root]
        else:
            raise ValueError(f"{path}: unsupported file type {root.suffix or '(none)'!r} ({_ALLOWED})")
        docs: dict[str, list[str]] = {}
        for file in files:
            for domain, text in (_read_jsonl(file) if file.suffix.lower() == ".jsonl" else _read_txt(file)):
                docs.setdefault(domain, []).append(text)
        return cls({name: _encode(tokenizer, texts) for name, texts in docs.items()},
                   tokenizer.get_vocab_size(with_added_tokens=True), source=str(path))

    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary (special tokens included): the model's embedding rows."""
        return self._vocab_size

    @property
    def sha256(self) -> str:
        """Digest of the domain names and token ids (identifies corpus and tokenization in checkpoints)."""
        if self._sha is None:
            digest = hashlib.sha256()
            for name, ids in self.domains.items():
                digest.update(name.encode() + b"\0" + ids.astype("<i4").tobytes() + b"\0")
            self._sha = digest.hexdigest()
        return self._sha


def read_text(file: Path) -> str:
    """The UTF-8 text of ``file``; ValueError naming the file and the problem for anything else (binary data,
    another encoding). Invalid bytes are refused, never replaced: training on mojibake is silent corruption. Only a
    regular file is read (after symlinks): a FIFO would block and a device never end."""
    try:
        regular = stat.S_ISREG(file.stat().st_mode)
    except OSError as error:
        raise ValueError(f"{file}: cannot read it ({error.strerror or error})") from None
    if not regular:
        raise ValueError(f"{file}: not a regular file (a pipe, device or socket); {_ALLOWED}")
    data = file.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{file}: binary data (a NUL byte at offset {nul}); expected UTF-8 text ({_ALLOWED})")
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # an editor's mark: no text to train on
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = start + error.start
        raise ValueError(f"{file}: not UTF-8 text (byte 0x{data[offset]:02x} at offset {offset}: "
                         f"{error.reason}); convert it to UTF-8") from None


def _check_size(file: Path, what: str, text: str) -> None:
    if len(text) > MAX_DOCUMENT_BYTES // 4 and len(text.encode("utf-8")) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"{file}: {what} is {len(text.encode('utf-8'))} bytes, over the {MAX_DOCUMENT_BYTES >> 20} "
                         "MiB limit for one document; split it (documents of a .txt file are separated by lines "
                         "holding only \\x1e, a .jsonl file has one document per line)")


def cache_dir() -> Path:
    """Where the bundled corpus's token ids are cached between processes: ``$BAGUALU2_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/bagualu2``, else ``~/.cache/bagualu2``."""
    if os.environ.get("BAGUALU2_CACHE_DIR"):
        return Path(os.environ["BAGUALU2_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bagualu2"


def _ids_digest(domains: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(domains):
        digest.update(name.encode() + b"\0" + np.ascontiguousarray(domains[name], dtype="<i4").tobytes())
    return digest.hexdigest()


def _cache_file(key: tuple[str, str]) -> Path:
    return cache_dir() / f"corpus-{_sha256('/'.join(key).encode())[:32]}.npz"


def data_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The files of a data folder read as data: ``.txt`` / ``.jsonl`` (``OK.TXT`` too), sorted, not recursive."""
    return sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in DATA_SUFFIXES)


def _regular_or_absent(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:  # a component that is not a folder, a name too long: no cache there
        return False


def _load_cached(key: tuple[str, str]) -> dict[str, np.ndarray] | None:
    """The cached token ids of ``key`` (archives' and tokenizer's sha256), if a cache file holds them intact (a
    path that is not a regular file, e.g. a FIFO that would block the read, is no cache)."""
    file = _cache_file(key)
    if not _regular_or_absent(file):
        return None
    try:
        with np.load(file, allow_pickle=False) as data:
            domains = {name: data[name] for name in DOMAINS}
            expected = str(data["digest"])
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError):
        return None
    return domains if _ids_digest(domains) == expected else None


def _store_cached(key: tuple[str, str], domains: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Write the cache file atomically (best effort: a cache that cannot be written is skipped, and so is one
    whose path holds something other than a regular file, which is never replaced)."""
    file = _cache_file(key)
    if not _regular_or_absent(file):
        return domains
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, digest=np.array(_ids_digest(domains)), **domains)
            os.replace(tmp, file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass
    return domains


def _read_txt(file: Path) -> Iterable[tuple[str, str]]:
    text = read_text(file)
    docs = [doc for doc in text.replace("\r\n", "\n").split(DOC_SEPARATOR) if doc.strip()]
    for number, doc in enumerate(docs, start=1):
        _check_size(file, f"document {number}", doc)
    if not docs:
        raise ValueError(f"{file}: empty data (no text; {_ALLOWED})")
    return [(file.stem, doc) for doc in docs]


def _read_jsonl(file: Path) -> Iterable[tuple[str, str]]:
    records = []
    # JSON lines end at "\n" only: str.splitlines() would also split at U+2028, U+0085, ... that JSON strings
    # may hold as they are
    for number, line in enumerate(read_text(file).split("\n"), start=1):
        if not line.strip():
            continue
        _check_size(file, f"line {number}", line)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}: line {number}: invalid JSON ({error.msg}); each line must be one JSON object "
                             'like {"text": "...", "domain": "..."}') from None
        except RecursionError:
            raise ValueError(f"{file}: line {number}: JSON nested too deeply; each line must be one JSON object "
                             'like {"text": "...", "domain": "..."}') from None
        text, domain = (record.get("text"), record.get("domain", "default")) if isinstance(record, dict) else (0, 0)
        if not isinstance(text, str) or not isinstance(domain, str) or not domain:
            raise ValueError(f'{file}: line {number}: expected an object with a string "text" and an optional '
                             'non-empty string "domain"')
        try:
            text.encode("utf-8"), domain.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800") is JSON but no text
            raise ValueError(f'{file}: line {number}: "text" or "domain" holds a lone surrogate (not Unicode '
                             "text)") from None
        if text.strip():
            records.append((domain, text))
    if not records:
        raise ValueError(f"{file}: empty data (no non-empty \"text\" lines; {_ALLOWED})")
    return records


class DomainBatches:
    """Deterministic micro-batches: ``micro_batch(step, index)`` is a pure function of ``(seed, step, index)``."""

    def __init__(self, corpus: TokenCorpus, *, seq_length: int, micro_batch_size: int, seed: int) -> None:
        for label, value, low in (("seq_length", seq_length, 1), ("micro_batch_size", micro_batch_size, 1),
                                  ("seed", seed, 0)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ValueError(f"{label} must be an integer >= {low}, got {value!r}")
        for name, ids in corpus.domains.items():
            if len(ids) < seq_length + 1:
                raise ValueError(f"{corpus.source}: domain {name!r} has {len(ids)} tokens, fewer than one sequence "
                                 f"(seq_length + 1 = {seq_length + 1}); add text to that domain")
        self.corpus, self.seq_length, self.micro_batch_size, self.seed = corpus, seq_length, micro_batch_size, seed
        self.names = tuple(corpus.domains)  # sorted
        self.next_step = 0
        self._offsets = np.arange(seq_length + 1, dtype=np.int64)

    def micro_batch(self, step: int, index: int) -> tuple[np.ndarray, np.ndarray, str]:
        """``(inputs, targets, domain)`` of global micro-batch ``index`` of iteration ``step``: int64 arrays of shape
        ``(micro_batch_size, seq_length)``, ``targets`` = ``inputs`` shifted by one token, all rows from ONE domain
        (chosen with equal probability), each row a uniformly random window of that domain's token stream."""
        if step < 0 or index < 0:
            raise ValueError(f"step and index must be >= 0, got step={step}, index={index}")
        rng = np.random.default_rng([int(self.seed), int(step), int(index)])
        domain = self.names[int(rng.integers(len(self.names)))]
        ids = self.corpus.domains[domain]
        starts = rng.integers(0, len(ids) - self.seq_length, size=self.micro_batch_size, dtype=np.int64)
        windows = ids[starts[:, None] + self._offsets].astype(np.int64)
        return windows[:, :-1], windows[:, 1:], domain

    def advance(self) -> None:
        """Mark the current iteration done: ``next_step += 1`` (call after each optimizer step)."""
        self.next_step += 1

    def state_dict(self) -> dict[str, Any]:
        """JSON-able resume state: ``{"next_step", "seed", "corpus_sha256"}``."""
        return {"next_step": self.next_step, "seed": int(self.seed), "corpus_sha256": self.corpus.sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; ``ValueError`` if it was saved with another seed or corpus."""
        missing = {"next_step", "seed", "corpus_sha256"} - set(state)
        if missing:
            raise ValueError(f"data loader state lacks {sorted(missing)}")
        if state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data was drawn with --seed {state['seed']}; this run has --seed "
                             f"{self.seed}")
        if state["corpus_sha256"] != self.corpus.sha256:
            raise ValueError(f"--data: the checkpoint was trained on another corpus or tokenizer "
                             f"({str(state['corpus_sha256'])[:12]}... vs {self.corpus.sha256[:12]}...)")
        if not isinstance(state["next_step"], int) or state["next_step"] < 0:
            raise ValueError(f"data loader state has an invalid next_step {state['next_step']!r}")
        self.next_step = state["next_step"]
