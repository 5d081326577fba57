#!/usr/bin/env python
"""Build the reference trainer's bundled mixed-domain corpus and its BPE tokenizer (offline, re-runnable).

Collects about 1.25 MB of real UTF-8 text per domain from files that exist on this machine:

* ``code``   -- Python standard-library sources (top-level modules and packages, no tests);
* ``prose``  -- licence texts (/usr/share/common-licenses, ``*.dist-info`` licence files), package descriptions
  (``METADATA`` bodies), Debian package READMEs/NEWS and git's release notes;
* ``tables`` -- tabular/numeric text: CSV/TSV/.dat/.tab files from site-packages (matplotlib sample data, numpy and
  scipy test tables, tzdata), /usr/share/zoneinfo, distro-info, PostgreSQL time-zone sets, Unicode data files
  and glibc charmaps.

Selection is deterministic: every group lists its candidate files in sorted order, skips binary / non-UTF-8 /
duplicate texts, truncates each file to a per-file cap (at a line boundary) and takes an evenly spaced subset
(a stride over the sorted list) until the group's byte budget is reached.

Outputs (in ``reference_trainer/corpus/``):

* ``{code,prose,tables}.txt.xz`` -- lzma (xz) text; documents are separated by a line holding only ``\\x1e``
  (ASCII record separator; source texts never contain that character), i.e. ``"\\n\\x1e\\n".join(docs) + "\\n"``;
* ``manifest.json`` -- per domain every source (path as found, licence family when evident, bytes and sha256 of
  the text taken), plus the sha256 and sizes of each ``.xz`` file and of ``tokenizer.json``;
* ``tokenizer.json`` -- byte-level BPE (Hugging Face ``tokenizers``), vocab 4096, special tokens
  ``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1), trained on the three domains.

Usage: ``python scripts/build_corpus.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import site
import subprocess
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEPARATOR = "\n\x1e\n"
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
VOCAB_SIZE = 4096
_ALLOWED_CONTROL = {"\t", "\n", "\f"}


@dataclass(frozen=True)
class Group:
    """One source family of a domain: sorted candidate files, a per-file cap and a byte budget."""

    name: str
    files: list[Path]
    file_cap: int
    budget: int


def clean_text(raw: bytes) -> str | None:
    """The file's text with CRLF normalised and trailing blanks stripped, or ``None`` if binary / not UTF-8."""
    if b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if any(ch < " " and ch not in _ALLOWED_CONTROL for ch in text) or "\x7f" in text:
        return None
    text = text.strip("\n").rstrip()
    return text or None


def read_text(path: Path) -> str | None:
    """Read (and gunzip ``*.gz``) a file; ``None`` if unreadable or binary."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    return clean_text(raw)


def truncate(text: str, cap: int) -> str:
    """``text`` cut to at most ``cap`` UTF-8 bytes, at the last line break before the cap."""
    data = text.encode("utf-8")
    if len(data) <= cap:
        return text
    head = data[:cap].decode("utf-8", errors="ignore")
    cut = head.rfind("\n")
    return head[:cut].rstrip() if cut > cap // 4 else head.rstrip()


def metadata_body(path: Path) -> str | None:
    """The long description of a ``METADATA`` file (the body after the header block)."""
    text = read_text(path)
    if text is None or "\n\n" not in text:
        return None
    body = text.split("\n\n", 1)[1].strip()
    return body if len(body) > 200 else None


def sorted_files(roots: Iterable[Path], patterns: Iterable[str], exclude: Callable[[Path], bool] = lambda p: False,
                 recursive: bool = True) -> list[Path]:
    """Regular files (not symlinks) under ``roots`` matching any glob pattern, sorted, deduplicated."""
    found: set[Path] = set()
    for root in roots:
        if not root.is_dir():
            continue
        for pattern in patterns:
            for path in (root.rglob(pattern) if recursive else root.glob(pattern)):
                if path.is_file() and not path.is_symlink() and not exclude(path):
                    found.add(path)
    return sorted(found, key=str)


# --- licence families ---------------------------------------------------------------------------------------------

class Licences:
    """Licence family of a source when evident: package metadata, Debian copyright files, known locations."""

    def __init__(self, site_dirs: list[Path], stdlib: Path) -> None:
        self.stdlib = stdlib
        self.by_top: dict[tuple[Path, str], str | None] = {}
        for site_dir in site_dirs:
            for dist in metadata.distributions(path=[str(site_dir)]):
                family = self._dist_family(dist)
                for record in dist.files or []:
                    top = record.parts[0] if record.parts else ""
                    self.by_top.setdefault((site_dir, top), family)
        self.site_dirs = site_dirs
        self.deb_cache: dict[str, str | None] = {}

    @staticmethod
    def _dist_family(dist: metadata.Distribution) -> str | None:
        meta = dist.metadata
        if meta.get("License-Expression"):
            return meta["License-Expression"]
        short = (meta.get("License") or "").strip()
        if short and "\n" not in short and len(short) <= 60 and short.upper() != "UNKNOWN":
            return short
        classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")]
        return classifiers[0] if classifiers else None

    @staticmethod
    def _copyright_family(text: str, package: str) -> str | None:
        """First short ``License:`` field of a Debian copyright file, else a licence named in its text."""
        for value in re.findall(r"^License:\s*(\S.*)$", text, re.M):
            if len(value) <= 60 and not value.startswith("The "):
                return f"{value.strip()} (Debian {package})"
        for phrase, family in (("GNU Lesser General Public", "LGPL"), ("GNU Library General Public", "LGPL"),
                               ("GNU General Public", "GPL"), ("Apache License", "Apache"),
                               ("public domain", "public-domain")):
            if phrase.lower() in text.lower():
                return f"{family} (Debian {package}, named in its copyright text)"
        return None

    def _debian(self, paths: list[Path]) -> dict[Path, str | None]:
        """Owning Debian package (``dpkg -S``) -> first ``License:`` of its copyright file."""
        result: dict[Path, str | None] = {}
        if not paths or shutil.which("dpkg") is None:
            return result
        out = subprocess.run(["dpkg", "-S", *map(str, paths)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            package, _, name = line.partition(": ")
            package = package.split(",")[0].split(":")[0].strip()
            if package not in self.deb_cache:
                copyright_file = Path("/usr/share/doc") / package / "copyright"
                text = copyright_file.read_text(errors="replace") if copyright_file.is_file() else ""
                self.deb_cache[package] = self._copyright_family(text, package)
            result[Path(name.strip())] = self.deb_cache[package]
        return result

    def families(self, paths: list[Path]) -> dict[Path, str | None]:
        """Licence family (or ``None``) for each path."""
        result: dict[Path, str | None] = {}
        debian: list[Path] = []
        for path in paths:
            if str(path).startswith("/usr/share/common-licenses/"):
                result[path] = f"licence text: {path.name}"
            elif any(path.is_relative_to(d) for d in self.site_dirs):
                site_dir = next(d for d in self.site_dirs if path.is_relative_to(d))
                result[path] = self.by_top.get((site_dir, path.relative_to(site_dir).parts[0]))
            elif path.is_relative_to(self.stdlib):
                result[path] = "PSF-2.0 (Python standard library)"
            elif str(path).startswith("/usr/"):
                debian.append(path)
            else:
                result[path] = None
        found = self._debian(debian)
        for path in debian:
            result[path] = found.get(path)
        return result


# --- selection ----------------------------------------------------------------------------------------------------

def select(group: Group, reader: Callable[[Path], str | None], seen: set[str]) -> list[tuple[Path, str]]:
    """Evenly spaced (stride over the sorted list) texts of ``group`` until its budget; skips duplicates."""
    texts = []
    for path in group.files:
        text = reader(path)
        if text is not None:
            texts.append((path, truncate(text, group.file_cap)))
    total = sum(len(t.encode()) for _, t in texts)
    stride = max(1, total // group.budget) if group.budget else 1
    order = texts[::stride] + [item for i, item in enumerate(texts) if i % stride]
    taken: list[tuple[Path, str]] = []
    used = 0
    for path, text in order:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen or used >= group.budget:
            continue
        seen.add(digest)
        taken.append((path, text))
        used += len(text.encode())
    return sorted(taken, key=lambda item: str(item[0]))


def groups(stdlib: Path, venv_site: Path, base_site: list[Path]) -> dict[str, list[tuple[Group, Callable]]]:
    """The source groups of each domain (paths sorted, caps in bytes)."""
    sites = [venv_site, *base_site]
    skip_code = re.compile(r"/(test|tests|idlelib|lib2to3|encodings|turtledemo|site-packages|__pycache__)/")
    stdlib_top = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    stdlib_pkgs = sorted_files([d for d in sorted(stdlib.iterdir()) if d.is_dir()], ["*.py"],
                             exclude=lambda p: bool(skip_code.search(str(p))))
    licence_files = sorted_files([venv_site], ["*.dist-info/LICEN[CS]E*", "*.dist-info/licenses/*",
                                               "*.dist-info/COPYING*"], recursive=False)
    licence_files += sorted_files(sorted(venv_site.glob("*.dist-info/licenses")), ["*"])
    readmes = sorted_files(sorted(Path("/usr/share/doc").glob("*")), ["README*", "NEWS*"], recursive=False,
                           exclude=lambda p: p.suffix in {".html", ".htm"} or p.name.endswith(".html.gz"))
    tables_site = sorted_files(sites, ["*.csv", "*.tsv", "*.tab", "*.dat"], exclude=lambda p: "dist-info" in str(p))
    plain = read_text
    return {
        "code": [
            (Group("stdlib modules", stdlib_top, 16_000, 700_000), plain),
            (Group("stdlib packages", stdlib_pkgs, 16_000, 550_000), plain),
        ],
        "prose": [
            (Group("common licences", sorted_files([Path("/usr/share/common-licenses")], ["*"]), 40_000, 220_000),
             plain),
            (Group("dist-info licences", sorted(set(licence_files), key=str), 24_000, 280_000), plain),
            (Group("package descriptions", sorted_files([venv_site], ["*.dist-info/METADATA"], recursive=False),
                   16_000, 260_000), metadata_body),
            (Group("Debian READMEs", readmes, 16_000, 300_000), plain),
            (Group("git release notes", sorted_files([Path("/usr/share/doc/git/RelNotes")], ["*.txt"]),
                   12_000, 190_000), plain),
        ],
        "tables": [
            (Group("matplotlib sample data", [p for p in tables_site if "sample_data" in str(p)], 64_000, 150_000),
             plain),
            (Group("numpy test tables", [p for p in tables_site if "/numpy/" in str(p)], 16_000, 300_000), plain),
            (Group("scipy test tables", [p for p in tables_site if "/scipy/" in str(p)], 40_000, 260_000), plain),
            (Group("time-zone tables", [p for p in tables_site if "zoneinfo" in str(p)]
                   + sorted_files([Path("/usr/share/zoneinfo")], ["*.tab"], recursive=False)
                   + sorted_files([Path("/usr/share/postgresql")], ["timezonesets/*"]), 32_000, 140_000), plain),
            (Group("distro-info", sorted_files([Path("/usr/share/distro-info")], ["*.csv"]), 32_000, 10_000), plain),
            (Group("Unicode data", sorted_files([Path("/usr/share/perl")], ["unicore/*.txt"]), 32_000, 60_000),
             plain),
            (Group("glibc charmaps", sorted_files([Path("/usr/share/i18n/charmaps")], ["*.gz"]), 24_000, 380_000),
             plain),
        ],
    }


def train_tokenizer(domains: dict[str, list[str]]) -> Tokenizer:
    """Byte-level BPE with ``VOCAB_SIZE`` entries (special tokens first) trained on all documents."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([doc for name in sorted(domains) for doc in domains[name]], trainer=trainer)
    return tokenizer


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "reference_trainer" / "corpus")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    venv_site = Path(sysconfig.get_paths()["purelib"]).resolve()
    base_site = sorted({Path(p).resolve() for p in [*site.getsitepackages(), str(stdlib / "site-packages")]
                        if Path(p).is_dir()} - {venv_site}, key=str)
    licences = Licences([venv_site, *base_site], stdlib)

    manifest: dict = {"separator": "a line holding only \\x1e: '\\n\\x1e\\n'.join(documents) + '\\n'",
                      "builder": "scripts/build_corpus.py", "domains": {}}
    documents: dict[str, list[str]] = {}
    seen: set[str] = set()
    for domain, domain_groups in groups(stdlib, venv_site, base_site).items():
        sources, docs = [], []
        for group, reader in domain_groups:
            taken = select(group, reader, seen)
            families = licences.families([path for path, _ in taken])
            for path, text in taken:
                data = text.encode("utf-8")
                sources.append({"path": str(path), "group": group.name, "licence": families.get(path),
                                "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
                docs.append(text)
        documents[domain] = docs
        payload = (SEPARATOR.join(docs) + "\n").encode("utf-8")
        xz_path = out / f"{domain}.txt.xz"
        xz_path.write_bytes(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))
        manifest["domains"][domain] = {
            "file": xz_path.name, "sha256": sha256_file(xz_path), "compressed_bytes": xz_path.stat().st_size,
            "raw_bytes": len(payload), "raw_sha256": hashlib.sha256(payload).hexdigest(),
            "documents": len(docs), "sources": sources}
        print(f"{domain:7s} {len(docs):4d} docs  raw {len(payload):>9,d} B  xz {xz_path.stat().st_size:>9,d} B")

    tokenizer = train_tokenizer(documents)
    tok_path = out / "tokenizer.json"
    tokenizer.save(str(tok_path))
    manifest["tokenizer"] = {"file": tok_path.name, "sha256": sha256_file(tok_path), "type": "byte-level BPE",
                             "vocab_size": tokenizer.get_vocab_size(), "special_tokens": SPECIAL_TOKENS}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"tokenizer vocab {tokenizer.get_vocab_size()}  -> {out}")


if __name__ == "__main__":
    main()
