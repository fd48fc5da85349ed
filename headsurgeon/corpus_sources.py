"""Corpora from outside the package: Hugging Face ``datasets`` and any iterable of texts, streamed.

Usage::

    texts = hs.load_dataset_texts("my-corpus/", split="train", column="text")
    census = hs.run_census(model, texts, n_seqs=64)  # reads only what 64 windows need
    census.attrs["data"]  # 'dataset my-corpus, split train, column text, revision 3f2a...'

Every verb that takes texts also takes a ``datasets.Dataset`` or ``datasets.IterableDataset``
itself (its text column found as :func:`dataset_texts` finds it) and any iterable of texts (a
generator too), read lazily: with ``n_seqs`` only as far as the sample needs, as a file is.

A dataset's rows are one corpus: joined by a blank line and cut into windows as one text, so
that rows shorter than a window (sentences, short documents) still fill windows. An iterable of
texts keeps each text on its own, as a list of texts does.

Exports:
    TextSource                 texts read lazily, and the record of where they came from
    load_dataset_texts(path_or_name, split=, column=, cache_dir=)
                               a dataset on disk or in the Hugging Face cache as a TextSource
    dataset_texts(dataset, column=, name=, revision=)
                               a ``datasets.Dataset`` / ``IterableDataset`` as a TextSource
    text_source(data)          a TextSource for a dataset or a lazy iterable, else None
    check_dataset_arg(text)    ``--dataset``'s check when parsed: a name, or a path that exists
    DATA_FILE_BUILDERS         the file suffixes read, and the ``datasets`` builder of each
    ROW_SEPARATOR              what joins a dataset's rows into one text: a blank line

Where a dataset comes from (``path_or_name``):

- a folder written by ``Dataset.save_to_disk`` (``state.json`` or ``dataset_dict.json`` in it):
  opened memory-mapped (``datasets.load_from_disk``), its rows read as they are needed;
- a JSON Lines, JSON, Parquet, CSV or Arrow file, or a folder of them (split by file names, as
  ``datasets.load_dataset`` splits a folder: ``train.jsonl``, ``test.jsonl``...): streamed
  (``load_dataset(..., streaming=True)``), nothing written to the cache;
- a dataset name (``NAME`` or ``ORG/NAME``) downloaded before into the ``datasets`` cache
  (``HF_DATASETS_CACHE``): read from there, never from the network. A name not in the cache is
  one line with the command that downloads it.

The revision recorded: for a cached hub dataset, the commit its cache folder is named after;
for local files, ``sha256`` of each data file's name, size and first and last MiB (16 hex
digits: a quick fingerprint that any append, truncation or edit at either end changes; a run
that resumes compares the tokens themselves); for a ``datasets.Dataset`` in memory, its own
``_fingerprint``; ``unknown`` for an ``IterableDataset`` in memory. Names are the folder's or
file's own name, never its path (outputs carry no machine paths).

``datasets`` is imported only when a dataset is opened (it takes a second): parsing
``--dataset`` and importing this module do not import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from headsurgeon.errors import DataError, HeadsurgeonError, InvalidArgumentError
from headsurgeon.inputs import MAX_TEXT_BYTES

__all__ = [
    "DATA_FILE_BUILDERS",
    "ROW_SEPARATOR",
    "TextSource",
    "check_dataset_arg",
    "dataset_texts",
    "load_dataset_texts",
    "text_source",
]

# The data files a path may name, and the datasets builder that reads each.
DATA_FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
# Rows joined into one text by a blank line; read in batches of this many rows.
ROW_SEPARATOR = "\n\n"
BATCH_ROWS = 1000
_FINGERPRINT_BYTES = 1 << 20
# A hub dataset id: NAME or ORG/NAME.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclasses.dataclass
class TextSource:
    """Texts read lazily, and where they came from.

    ``parts()``: the texts, each a text (``str``), a file (``Path``) or one text in pieces (an
    iterator of ``str``: a dataset's rows, joined); read by :func:`headsurgeon.data.as_sequences`
    only as far as its sample needs. A dataset's source opens its rows afresh at each read, so it
    serves any number of verbs; an iterable that can be read only once (a generator) is
    ``once``: a second read is one line. ``description``: where they came from, in words
    (``Sequences.source``, every result's ``attrs["data"]``). ``record``: for a dataset, its
    ``name``, ``split``, ``column`` and ``revision`` (``Sequences.dataset``), else ``None``.
    """

    parts: Callable[[], Iterator[str | Path | Iterator[str]]]
    description: str
    record: dict[str, str | None] | None = None
    once: bool = False

    def __post_init__(self) -> None:
        self._used = False

    def take(self) -> Iterator[str | Path | Iterator[str]]:
        """The parts: a fresh read, or for a ``once`` source its only one (a second read is one
        line: the first consumed them)."""
        if self.once and self._used:
            raise DataError(
                f"the texts of {self.description} were read already (an iterator is read "
                "once); pass a list or a dataset, or make Sequences once with hs.to_sequences"
            )
        self._used = True
        return self.parts()


def check_dataset_arg(text: str) -> str:
    """``text`` if it can name a dataset: an existing file or folder, or a hub name (``NAME`` or
    ``ORG/NAME``) to find in the cache; one :class:`InvalidArgumentError` line for a path that
    does not exist (checked without importing ``datasets``).

    >>> check_dataset_arg("wikitext")
    'wikitext'
    >>> check_dataset_arg("./no/such/folder")
    Traceback (most recent call last):
    ...
    headsurgeon.errors.InvalidArgumentError: dataset ./no/such/folder does not exist; ...
    """
    if os.path.lexists(os.path.expanduser(text)) or (
        _HUB_NAME.fullmatch(text) and _suffix(text) is None
    ):
        return text
    raise InvalidArgumentError(
        f"dataset {text} does not exist; give a dataset folder or file (JSON Lines, Parquet, "
        "CSV, Arrow, or a save_to_disk folder), or a dataset name (NAME or ORG/NAME) in the "
        "Hugging Face datasets cache"
    )


def _suffix(name: str) -> str | None:
    """The data-file suffix ``name`` ends with (``.jsonl``, also ``.jsonl.gz``), or None."""
    stem = name.removesuffix(".gz")
    return next((s for s in DATA_FILE_BUILDERS if stem.endswith(s)), None)


def load_dataset_texts(
    path_or_name: str | os.PathLike,
    split: str = "train",
    column: str | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
) -> TextSource:
    """The texts of one split of a dataset on disk or in the ``datasets`` cache (see the module's
    docs for what ``path_or_name`` may be), streamed.

    ``column``: the text column (default: ``text`` if the dataset has one, else its only string
    column); ``cache_dir``: the ``datasets`` cache a name is looked up in (default:
    ``HF_DATASETS_CACHE``). Bad input (a missing path or split, a column that is not there or
    not text, a file that does not parse, a name not in the cache) is one :class:`DataError`
    line, some of it when the rows are read.
    """
    text = os.fspath(path_or_name)
    check_dataset_arg(text)
    if not isinstance(split, str) or not split:
        raise InvalidArgumentError(f"split must be a split name such as 'train', got {split!r}")
    path = Path(text).expanduser()
    if path.exists():
        dataset = _open_local(path, split)
        revision = _files_fingerprint(path)
        name = path.resolve().name
    else:
        dataset, revision = _open_cached(text, split, cache_dir)
        name = text
    return dataset_texts(dataset, column, name=name, split=split, revision=revision)


def _datasets():
    """The ``datasets`` package, imported on first use (a second of imports)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a declared dependency
        raise DataError(
            "reading a dataset needs the datasets package; pip install 'datasets>=3'"
        ) from None
    return datasets


def _open_local(path: Path, split: str) -> Any:
    datasets = _datasets()
    if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
        with _read_errors(path.name):
            saved = datasets.load_from_disk(str(path))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise DataError(
                    f"dataset {path.name} has no split {split}; give --split one of "
                    f"{', '.join(saved)}"
                )
            return saved[split]
        own = "train" if saved.split is None else str(saved.split)  # one split, by any name
        if split not in ("train", own):
            raise DataError(
                f"dataset {path.name} is one split ({own}), not {split}; leave out --split"
            )
        return saved
    if path.is_dir():
        names = [p.name for p in path.rglob("*") if p.is_file()]
        if not any(_suffix(name) for name in names):
            texts = any(name.endswith((".txt", ".txt.gz")) for name in names)
            raise DataError(
                f"dataset folder {path.name} holds no {', '.join(DATA_FILE_BUILDERS)} file and no "
                "save_to_disk dataset"
                + ("; text files go to --texts (texts= in Python)" if texts else "")
            )
        with _read_errors(path.name):
            return datasets.load_dataset(str(path), split=split, streaming=True)
    suffix = _suffix(path.name)
    if suffix is None:
        text = path.name.endswith((".txt", ".txt.gz"))
        hint = "; text files go to --texts (texts= in Python)" if text else ""
        raise DataError(
            f"dataset file {path.name} is not one of {', '.join(DATA_FILE_BUILDERS)} (or a "
            f"folder of them){hint}"
        )
    if split != "train":
        raise DataError(
            f"dataset file {path.name} is one split (train), not {split}; give the folder "
            "holding one file per split, or leave out --split"
        )
    with _read_errors(path.name):
        return datasets.load_dataset(
            DATA_FILE_BUILDERS[suffix], data_files=str(path), split="train", streaming=True
        )


def _open_cached(name: str, split: str, cache_dir: str | os.PathLike | None) -> tuple[Any, str]:
    """A hub dataset as ``datasets`` cached it, and its revision (the cache folder's name), read
    from the cache alone: no network, whatever ``HF_DATASETS_OFFLINE`` says."""
    _datasets()
    from datasets.packaged_modules.cache.cache import Cache

    try:
        builder = Cache(
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            repo_id=name,
            dataset_name=name.split("/")[-1],
            version="auto",
            hash="auto",
        )
    except ValueError as e:
        first = str(e).splitlines()[0]
        if "multiple" in first:
            raise DataError(
                f"dataset {name}: {first}; keep one configuration in the cache"
            ) from None
        raise DataError(
            f"dataset {name} is neither a local path nor in the datasets cache; download it "
            f'once where the network reaches the Hugging Face hub: python -c "import datasets; '
            f"datasets.load_dataset('{name}')\" (HF_DATASETS_CACHE names the cache)"
        ) from None
    with _read_errors(name):
        available = list(builder.info.splits or {})
        if split not in available:
            raise DataError(
                f"dataset {name} has no split {split}; give --split one of {', '.join(available)}"
            )
        return builder.as_dataset(split=split), str(builder.hash)


@contextlib.contextmanager
def _read_errors(name: str) -> Iterator[None]:
    """What ``datasets`` or ``pyarrow`` raise about the data, as one :class:`DataError` line
    naming the dataset (errors of this code itself pass as they are)."""
    try:
        yield
    except (HeadsurgeonError, TypeError, AttributeError, NameError):
        raise
    except Exception as error:
        lines = [line for line in str(error).splitlines() if line.strip()]
        detail = lines[0] if lines else type(error).__name__
        if "split" in detail.lower() and "available" in detail.lower():
            raise DataError(f"dataset {name}: {detail}; give --split one of those") from None
        raise DataError(
            f"cannot read dataset {name} ({detail[:300]}); check that its files are JSON Lines, "
            "JSON, Parquet, CSV or Arrow as their names say"
        ) from None


def _files_fingerprint(path: Path) -> str:
    """16 hex digits of sha256 over each data file's name (relative to ``path``), size and first
    and last :data:`_FINGERPRINT_BYTES` bytes: bounded work, whatever the dataset's size."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        rel = file.relative_to(path).as_posix() if path.is_dir() else file.name
        if any(part.startswith(".") for part in Path(rel).parts):
            continue  # .cache/, .git/, editor files: not the data
        size = file.stat().st_size
        digest.update(f"{rel}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_FINGERPRINT_BYTES))
            if size > _FINGERPRINT_BYTES:
                f.seek(max(_FINGERPRINT_BYTES, size - _FINGERPRINT_BYTES))
                digest.update(f.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def _is_dataset(data: object) -> bool:
    """Whether ``data`` is a ``datasets`` object (checked without importing ``datasets``: if it
    is not imported, ``data`` cannot be one)."""
    datasets = sys.modules.get("datasets")
    kinds = ("Dataset", "IterableDataset", "DatasetDict", "IterableDatasetDict")
    return datasets is not None and isinstance(
        data, tuple(getattr(datasets, k) for k in kinds if hasattr(datasets, k))
    )


def _string_columns(features: Mapping[str, Any] | None) -> list[str] | None:
    if features is None:
        return None
    return [
        name
        for name, feature in features.items()
        if getattr(feature, "dtype", None) in ("string", "large_string")
    ]


def _choose_column(dataset: Any, column: str | None, name: str) -> str:
    columns = list(dataset.column_names or [])
    strings = _string_columns(dataset.features)
    listed = ", ".join(columns) or "none"
    if column is not None:
        if columns and column not in columns:
            raise DataError(
                f"dataset {name} has no column {column!r}; its columns: {listed} "
                "(--column chooses one)"
            )
        if strings is not None and column not in strings:
            raise DataError(
                f"column {column!r} of dataset {name} is {dataset.features[column]}, not text; "
                f"choose a text column: {', '.join(strings) or 'it has none'}"
            )
        return column
    if strings is None:  # an IterableDataset whose features are unknown until read
        return "text"
    if "text" in strings:
        return "text"
    if len(strings) == 1:
        return strings[0]
    what = "several text columns" if strings else "no text column"
    raise DataError(
        f"dataset {name} has {what} ({listed}); choose one with --column (column= in Python)"
    )


def dataset_texts(
    dataset: Any,
    column: str | None = None,
    *,
    name: str | None = None,
    split: str | None = None,
    revision: str | None = None,
) -> TextSource:
    """A ``datasets.Dataset`` or ``datasets.IterableDataset`` as a :class:`TextSource`: its rows'
    ``column`` (default: ``text``, else the only string column; several or none is one line
    naming the columns) joined by a blank line, read in batches as they are needed.

    ``name``, ``split`` and ``revision`` are what the record says (default: the dataset's own
    name, split and fingerprint). A row whose value is not a string is one line (an empty,
    ``None`` value is skipped); a dataset with no rows is one line when read.
    """
    if not _is_dataset(dataset):
        raise InvalidArgumentError(
            f"expected a datasets.Dataset or IterableDataset, got {type(dataset).__name__}"
        )
    datasets = sys.modules["datasets"]
    if isinstance(dataset, (datasets.DatasetDict, getattr(datasets, "IterableDatasetDict", ()))):
        raise DataError(
            f"a {type(dataset).__name__} holds splits ({', '.join(dataset)}); pass one of them, "
            f"e.g. dataset[{next(iter(dataset), 'train')!r}]"
        )
    info = getattr(dataset, "info", None)
    name = name or getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)
    name = name or "in memory"
    split = split or (None if dataset.split is None else str(dataset.split))
    revision = revision or getattr(dataset, "_fingerprint", None) or "unknown"
    column = _choose_column(dataset, column, name)
    record = {"name": name, "split": split, "column": column, "revision": revision}
    description = (
        f"dataset {name}, split {split or 'unnamed'}, column {column}, revision {revision}"
    )
    return TextSource(lambda: iter([_rows(dataset, column, name)]), description, record)


def _rows(dataset: Any, column: str, name: str) -> Iterator[str]:
    """The text of ``column``, batch by batch, rows joined by :data:`ROW_SEPARATOR`; at most
    :data:`~headsurgeon.inputs.MAX_TEXT_BYTES` characters (a sample stops reading long before)."""
    n_rows = total = 0
    with _read_errors(name):
        if dataset.column_names is not None and column not in dataset.column_names:
            raise DataError(
                f"dataset {name} has no column {column!r}; its columns: "
                f"{', '.join(dataset.column_names)} (--column chooses one)"
            )
        for batch in dataset.select_columns([column]).iter(batch_size=BATCH_ROWS):
            values = batch[column]
            bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
            if bad is not None:
                raise DataError(
                    f"column {column!r} of dataset {name} holds {type(bad).__name__} values, not "
                    "text; choose a text column with --column (column= in Python)"
                )
            texts = [v for v in values if v]
            if not texts:
                continue
            chunk = ROW_SEPARATOR.join(texts)
            if n_rows:
                chunk = ROW_SEPARATOR + chunk
            n_rows, total = n_rows + len(texts), total + len(chunk)
            if total > MAX_TEXT_BYTES:
                raise DataError(
                    f"dataset {name} holds more than {MAX_TEXT_BYTES >> 30} GiB of text; sample "
                    "it with --n-seqs (n_seqs= in Python), or give a part of it "
                    "(dataset.take(n) or .select(range(n)))"
                )
            yield chunk
    if not n_rows:
        raise DataError(
            f"dataset {name} has no text in column {column!r} (no rows, or all empty); give a "
            "dataset with rows"
        )


def text_source(data: object) -> TextSource | None:
    """``data`` as a :class:`TextSource` when it is one, a ``datasets`` dataset, or a lazy
    iterable of texts (a generator, an iterator: anything iterable but not a ``str``, a path,
    a sequence such as a list, or a mapping); else ``None`` (the caller reads it as it is)."""
    if isinstance(data, TextSource):
        return data
    if _is_dataset(data):
        return dataset_texts(data)
    lazy = isinstance(data, Iterable) and not isinstance(
        data, (str, bytes, os.PathLike, Sequence, Mapping)
    )
    if not lazy or hasattr(data, "shape"):  # a tensor or an array is not texts
        return None
    # An iterator (a generator) is its own iterator: read once. A container is read afresh.
    return TextSource(
        lambda: _texts(data), f"texts from a {type(data).__name__}", once=iter(data) is data
    )


def _texts(items: Iterable[object]) -> Iterator[str | Path]:
    """Each item of a lazy iterable as a text or a file, checked as it comes; at most
    :data:`~headsurgeon.inputs.MAX_TEXT_BYTES` characters of text in all."""
    total, given = 0, False
    for item in items:
        given = True
        if isinstance(item, str):
            total += len(item)
            if total > MAX_TEXT_BYTES:
                raise DataError(
                    f"the texts hold more than {MAX_TEXT_BYTES >> 30} GiB; sample them with "
                    "n_seqs=, or give fewer (itertools.islice)"
                )
            yield item
        elif isinstance(item, os.PathLike):
            yield Path(item)
        else:
            raise DataError(
                f"the texts must be strings (or text files); one is of type {type(item).__name__}"
            )
    if not given:
        raise DataError(
            "no texts given; pass at least one text or file (an iterator or generator read "
            "before gives none: pass a list, or make Sequences once with hs.to_sequences)"
        )
