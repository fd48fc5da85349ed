"""Corpora from outside the package: Hugging Face ``datasets`` and any iterable of texts, streamed.

Usage::

    texts = hs.load_dataset_texts("my-corpus/", split="train", column="text")
    census = hs.run_census(model, hs.to_sequences(model, texts, n_seqs=64))  # reads 64 windows
    census.attrs["data"]  # 'dataset my-corpus, split train, column text, revision 3f2a...'

Every verb that takes texts also takes a ``datasets.Dataset`` or ``datasets.IterableDataset``
itself (its text column found as :func:`dataset_texts` finds it) and any iterable of texts (a
generator too), read lazily: with ``n_seqs`` only as far as the sample needs.

A dataset's rows are one corpus: joined by a blank line and cut into windows as one text, so
that rows shorter than a window (sentences, short documents) still fill windows. An iterable of
texts keeps each text on its own, as a list of texts does. A dataset is read by bytes, whatever
its rows' sizes: :data:`BATCH_ROWS` rows at a time, their text handed on in chunks of about
:data:`CHUNK_CHARS` characters; with ``n_seqs`` it is read from its start only until the
``n_seqs`` windows exist (texts and files are sampled over their first ``2**23`` tokens or more:
:func:`headsurgeon.data.to_sequences`); shuffle it first (``dataset.shuffle(seed=0)``) for a
sample from all of it.

Where a dataset comes from (``path_or_name``):

- a folder written by ``Dataset.save_to_disk`` (``state.json`` or ``dataset_dict.json`` in it):
  opened memory-mapped (``datasets.load_from_disk``), its rows read as they are needed;
- a JSON Lines, JSON, Parquet, CSV or Arrow file, or a folder of them (split by file names, as
  ``datasets.load_dataset`` splits a folder: ``train.jsonl``, ``test.jsonl``...): streamed
  (``load_dataset(..., streaming=True)``; JSON Lines line by line with Python's ``json``),
  nothing written to the cache. A path is a path: its files are listed here and handed on with
  glob characters escaped (``data[1].jsonl`` is that file, ``a*.jsonl`` not ``ab.jsonl``).

A path is resolved once (``~`` expanded, links followed), the same way for reading and for the
tools' input/output overlap check, and only files inside it are read: a data file that is a
symbolic link out of the folder, or a ``state.json`` naming ``../other/...``, is one line. So
is an empty file, a symbolic link loop, a FIFO, a JSON Lines row over :data:`MAX_ROW_BYTES`
or JSON nested deeper than :data:`MAX_JSON_DEPTH` (refused before any reader parses it: JSON
nested 20,000 deep crashed pyarrow's reader, and the process). While ``datasets`` reads for
us it logs nothing (its messages name files by absolute path) and asks the hub nothing.
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
import glob
import gzip
import hashlib
import itertools
import json
import logging
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from headsurgeon.errors import DataError, HeadsurgeonError, InvalidArgumentError
from headsurgeon.inputs import (
    MAX_JSON_BYTES,
    MAX_TEXT_BYTES,
    describe_kind,
    read_json,
    read_text,
)
from headsurgeon.validation import check_int

__all__ = [
    "TextSource",
    "load_dataset_texts",
]

# The data files a path may name, and the datasets builder that reads each.
DATA_FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
# Rows joined into one text by a blank line.
ROW_SEPARATOR = "\n\n"
# Memory follows the bytes read, not a count of rows (1,000 rows of 1 MB were a gigabyte): rows
# are fetched a few at a time, the readers' own batches kept as small (CSV, Parquet), and their
# text handed on in chunks of about CHUNK_CHARS characters.
BATCH_ROWS = 16
CHUNK_CHARS = 1 << 20
# A JSON Lines row is read whole: longer is one line, not a gigabyte in memory.
MAX_ROW_BYTES = MAX_JSON_BYTES
# JSON nested deeper than this is no text dataset: refused before pyarrow's reader (which
# crashes the process at 20,000 levels) sees the file.
MAX_JSON_DEPTH = 100
_JSON_TOKEN = re.compile(rb'"(?:[^"\\\n]|\\.)*"|[\[\]{}]')  # a whole string, or a bracket
# An absolute path in a reader's message, shown by its last name (outputs carry no machine paths).
_ABSOLUTE = re.compile(r"(?:/[^\s'\"/]+)+/?")
_READER_BATCH = {"csv": {"chunksize": BATCH_ROWS}, "parquet": {"batch_size": BATCH_ROWS}}
_FINGERPRINT_BYTES = 1 << 20
# A hub dataset id: NAME or ORG/NAME.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclasses.dataclass
class TextSource:
    """Texts read lazily, and where they came from: iterating gives its texts (``str``, read as
    consumed; a dataset's are its rows), ``take(n)`` the first ``n`` as a list.

    ``parts()``: what the verbs read (:func:`headsurgeon.data.as_sequences`, only as far as its
    sample needs), each a text, a file (``Path``) or one text in pieces (a dataset's rows,
    joined); ``rows()``: a dataset's rows one by one, else None. A dataset's source reads its
    rows afresh each time; an iterable that can be read only once (a generator) is ``once``: a
    second read is one line. ``description``: where they came from, in words
    (``Sequences.source``, every result's ``attrs["data"]``). ``record``: for a dataset, its
    ``name``, ``split``, ``column`` and ``revision`` (``Sequences.dataset``), else ``None``.
    """

    parts: Callable[[], Iterator[str | Path | Iterator[str]]]
    description: str
    record: dict[str, str | None] | None = None
    once: bool = False
    rows: Callable[[], Iterator[str]] | None = None

    def __post_init__(self) -> None:
        self._used = False

    def read(self) -> Iterator[str | Path | Iterator[str]]:
        """The parts: a fresh read, or for a ``once`` source its only one (a second read is one
        line: the first consumed them)."""
        if self.once and self._used:
            raise DataError(
                f"the texts of {self.description} were read already (an iterator is read "
                "once); pass a list or a dataset, or make Sequences once with hs.to_sequences"
            )
        self._used = True
        return self.parts()

    def __iter__(self) -> Iterator[str]:
        """The texts, read as they are consumed: a dataset's rows, a file's whole text."""
        if self.rows is not None:  # a dataset: read afresh each time
            yield from self.rows()
            return
        for part in self.read():
            if isinstance(part, Path):
                yield read_text(part, "text file")
            else:
                yield part if isinstance(part, str) else "".join(part)

    def take(self, n: int) -> list[str]:
        """The first ``n`` texts (fewer if it holds fewer), read no further."""
        check_int(n, "n", minimum=1)
        return list(itertools.islice(iter(self), n))


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
    expanded = os.path.expanduser(text)
    if os.path.lexists(expanded):
        return expanded  # "~/x" quoted past the shell: the path, as reading and checks see it
    if _HUB_NAME.fullmatch(text) and _suffix(text) is None:
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
    text = check_dataset_arg(os.fspath(path_or_name))
    if not isinstance(split, str) or not split:
        raise InvalidArgumentError(f"split must be a split name such as 'train', got {split!r}")
    if os.path.lexists(text):  # a path, read as named: never a glob, never a hub name
        path = _local_path(text)
        dataset = _open_local(path, split)
        revision = _files_fingerprint(path)
        name = path.name
    else:
        dataset, revision = _open_cached(text, split, cache_dir)
        name = text
    return dataset_texts(dataset, column, name=name, split=split, revision=revision)


def _local_path(text: str | os.PathLike) -> Path:
    """``text`` as the dataset path read: ``~`` expanded, symbolic links and ``..`` resolved,
    the same path the input/output overlap check compares; one line for a path that cannot
    be (a symbolic link loop, a broken link)."""
    given = Path(text).expanduser()
    kind = describe_kind(given)
    if kind is not None and "link" in kind:  # a loop, a broken link: not a name to look up
        raise DataError(f"dataset {given.name} is {kind}; give the dataset's own folder or file")
    try:
        return given.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise DataError(f"cannot open dataset {given.name} ({e.strerror or e})") from None


def _datasets():
    """The ``datasets`` package, imported on first use (a second of imports)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a declared dependency
        raise DataError(
            "reading a dataset needs the datasets package; pip install 'datasets>=3'"
        ) from None
    return datasets


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """``datasets`` quiet and local while it reads for us: no log lines or progress bars (they
    name the user's files by absolute path; outputs carry no machine paths, and what they would
    say reaches the user as our one line), no download-count request to the hub for a local
    file (seconds offline). Its settings restored after."""
    datasets = _datasets()
    loggers = [logging.getLogger(n) for n in ("datasets", "huggingface_hub", "fsspec")]
    levels = [logger.level for logger in loggers]
    bars, counts = datasets.is_progress_bar_enabled(), datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    datasets.disable_progress_bars()
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts


def _open_local(path: Path, split: str) -> Any:
    """The rows of ``split`` of the dataset at ``path`` (resolved): a save_to_disk folder, or
    data files read as named (listed here, handed on with glob characters escaped), each
    checked to be a non-empty regular file inside ``path``."""
    datasets = _datasets()
    if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
        _check_saved_files(path)
        with _read_errors(path.name), _quiet():
            saved = datasets.load_from_disk(str(path))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise DataError(
                    f"dataset {path.name} has no split {split}; give split= one of "
                    f"{', '.join(saved)}"
                )
            return saved[split]
        own = "train" if saved.split is None else str(saved.split)  # one split, by any name
        if split not in ("train", own):
            raise DataError(
                f"dataset {path.name} is one split ({own}), not {split}; leave out split="
            )
        return saved
    files = _split_files(path, split)
    for file in files:
        _check_data_file(path, file)
    builders = {DATA_FILE_BUILDERS[_suffix(f.name)] for f in files}
    if len(builders) > 1:
        raise DataError(
            f"dataset {path.name}'s split {split} mixes file kinds ({', '.join(sorted(builders))});"
            " give a folder of one kind"
        )
    builder = builders.pop()
    if all(_suffix(f.name) == ".jsonl" for f in files):
        return datasets.IterableDataset.from_generator(
            _json_lines_rows, gen_kwargs={"files": files}, split=datasets.NamedSplit(split)
        )
    if builder == "json":
        for file in files:
            _check_json_depth(file)
    escaped = [glob.escape(str(f)) for f in files]  # datasets globs data_files: a name is a name
    with _read_errors(path.name), _quiet():
        return datasets.load_dataset(
            builder,
            data_files={split: escaped},
            split=split,
            streaming=True,
            **_READER_BATCH.get(builder, {}),
        )


def _split_files(path: Path, split: str) -> list[Path]:
    """The data files of ``split``: ``path`` itself (a file: one split, train), or the files of a
    folder that ``datasets`` would give that split, found with the folder's name escaped."""
    if not path.is_dir():
        return _file_split(path, split)
    entries = [p for p in path.rglob("*") if not p.is_dir()]
    for entry in entries:  # a loop, a FIFO named train.jsonl: said, not silently passed over
        if _suffix(entry.name) and not entry.is_file():
            _check_data_file(path, entry)
    names = [p.name for p in entries]
    if not any(_suffix(name) for name in names):
        raise DataError(
            f"dataset folder {path.name} holds no {', '.join(DATA_FILE_BUILDERS)} file and no "
            f"save_to_disk dataset{_text_hint(names)}"
        )
    from datasets.data_files import DataFilesDict, get_data_patterns

    base = glob.escape(str(path))
    with _read_errors(path.name), _quiet():
        splits = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base)
    found = {str(k): [Path(f) for f in v if _suffix(Path(f).name)] for k, v in splits.items()}
    found = {k: v for k, v in found.items() if v}
    if split not in found:
        raise DataError(
            f"dataset {path.name} has no split {split}; give split= one of "
            f"{', '.join(found) or 'none'}"
        )
    return found[split]


def _file_split(path: Path, split: str) -> list[Path]:
    """``[path]``: a data file is one split, train (one line for another file or split)."""
    if _suffix(path.name) is None:
        raise DataError(
            f"dataset file {path.name} is not one of {', '.join(DATA_FILE_BUILDERS)} (or a "
            f"folder of them){_text_hint([path.name])}"
        )
    if split != "train":
        raise DataError(
            f"dataset file {path.name} is one split (train), not {split}; give the folder "
            "holding one file per split, or leave out split="
        )
    return [path]


def _text_hint(names: list[str]) -> str:
    """The end of a refusal for ``names`` holding a text file: texts go by path (else "")."""
    texts = any(name.endswith((".txt", ".txt.gz")) for name in names)
    return "; text files are texts: pass their paths, not load_dataset_texts" if texts else ""


def _check_data_file(folder: Path, file: Path) -> None:
    """One line unless ``file`` is a non-empty regular file inside ``folder`` (resolved: a
    symbolic link out of the folder is refused, as a save_to_disk state naming ``../``)."""
    shown = file.relative_to(folder).as_posix() if file != folder else file.name
    kind = describe_kind(file)
    if kind is not None:
        raise DataError(f"dataset file {shown} is {kind}; give a regular file")
    target = file.resolve()
    inside = folder if folder.is_dir() else folder.parent
    if target != folder and not target.is_relative_to(inside):
        raise DataError(
            f"dataset file {shown} lies outside the dataset folder {folder.name} (a symbolic "
            "link out of it); copy the file into the folder, or name its own folder"
        )
    if target.stat().st_size == 0:
        raise DataError(f"dataset file {shown} is empty (0 bytes); remove it or give rows in it")


def _check_saved_files(path: Path) -> None:
    """One line unless every data file a save_to_disk folder's ``state.json`` names (each
    split's, for a ``dataset_dict.json``) is a file inside ``path``: a state naming
    ``../other/...`` is not followed out of the folder the user named."""
    folders = [path]
    if (path / "dataset_dict.json").is_file():
        listed = read_json(path / "dataset_dict.json", "dataset_dict.json").get("splits", [])
        folders = [path / str(s) for s in listed] if isinstance(listed, list) else []
    for folder in folders:
        if not folder.resolve().is_relative_to(path):
            raise DataError(
                f"dataset {path.name}'s dataset_dict.json names a split outside its folder; "
                "a save_to_disk folder holds its own files: save it again"
            )
        state = folder / "state.json"
        files = read_json(state, "state.json").get("_data_files") if state.is_file() else None
        for entry in files if isinstance(files, list) else []:  # datasets says what is missing
            name = entry.get("filename") if isinstance(entry, dict) else None
            if not isinstance(name, str) or not (folder / name).resolve().is_relative_to(path):
                raise DataError(
                    f"dataset {path.name}'s state.json names a data file outside its folder "
                    f"({name!r}); a save_to_disk folder holds its own files: save it again"
                )


def _check_json_depth(file: Path) -> None:
    """One line if ``file``'s JSON nests deeper than :data:`MAX_JSON_DEPTH`: a streaming scan of
    the brackets outside strings (JSON strings hold no raw line break, so each line's strings
    are whole), bounded memory, before pyarrow's reader could crash on it."""
    depth = 0
    with _open_binary(file) as f:
        for number, line in enumerate(f, 1):
            depth = _nesting(file, number, line, depth)


def _nesting(file: Path, number: int, line: bytes, depth: int = 0) -> int:
    """The JSON nesting depth after ``line`` (line ``number`` of ``file``), from ``depth``
    before it; one line past :data:`MAX_JSON_DEPTH`."""
    for match in _JSON_TOKEN.finditer(line):
        mark = match.group()[:1]
        if mark in b"[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise DataError(
                    f"dataset file {file.name}: line {number} nests deeper than "
                    f"{MAX_JSON_DEPTH} levels of JSON, which no text dataset needs and JSON "
                    "readers can crash on; remove that row"
                )
        elif mark in b"]}":
            depth = max(depth - 1, 0)
    return depth


def _open_binary(file: Path):
    raw = open(file, "rb")  # noqa: SIM115 - closed by the caller's with, through the gzip file
    return gzip.GzipFile(fileobj=raw) if file.name.endswith(".gz") else raw


def _json_lines_rows(files: list[Path]) -> Iterator[dict[str, Any]]:
    """The rows of JSON Lines files, parsed one line at a time with Python's ``json`` (bounded:
    a line of more than :data:`MAX_ROW_BYTES` or nested deeper than :data:`MAX_JSON_DEPTH` is
    one line, never a crash), as far as the reader goes."""
    for file in files:
        with _open_binary(file) as f:
            number = 0
            try:
                while line := f.readline(MAX_ROW_BYTES + 1):
                    number += 1
                    if len(line) > MAX_ROW_BYTES:
                        raise DataError(
                            f"dataset file {file.name}: line {number} is longer than "
                            f"{MAX_ROW_BYTES >> 20} MiB; split that row"
                        )
                    if line.strip():
                        yield _json_row(file, number, line)
            except (OSError, EOFError, zlib.error) as e:
                raise DataError(
                    f"cannot read dataset file {file.name} ({e}); check the file (a .gz file "
                    "must be whole)"
                ) from None


def _json_row(file: Path, number: int, line: bytes) -> dict[str, Any]:
    where = f"dataset file {file.name}: line {number}"
    if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH:  # else it cannot nest deeper
        _nesting(file, number, line)
    try:
        row = json.loads(line)
    except UnicodeDecodeError:
        raise DataError(f"{where} is not UTF-8; give UTF-8 JSON Lines") from None
    except ValueError as e:
        raise DataError(f"{where} is not JSON ({e.msg}, column {e.colno}); fix that line") from None
    if not isinstance(row, dict):
        raise DataError(
            f"{where} is a JSON {type(row).__name__}, not an object; each line of a JSON Lines "
            'dataset is one row, such as {"text": "..."}'
        )
    return row


def _open_cached(name: str, split: str, cache_dir: str | os.PathLike | None) -> tuple[Any, str]:
    """A hub dataset as ``datasets`` cached it, and its revision (the cache folder's name), read
    from the cache alone: no network, whatever ``HF_DATASETS_OFFLINE`` says."""
    _datasets()
    from datasets.packaged_modules.cache.cache import Cache

    try:
        with _quiet():
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
    with _read_errors(name), _quiet():
        available = list(builder.info.splits or {})
        if split not in available:
            raise DataError(
                f"dataset {name} has no split {split}; give split= one of {', '.join(available)}"
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
        detail = _ABSOLUTE.sub(lambda m: Path(m.group()).name, lines[0]) if lines else ""
        detail = detail or type(error).__name__
        if "split" in detail.lower() and "available" in detail.lower():
            raise DataError(f"dataset {name}: {detail}; give split= one of those") from None
        raise DataError(
            f"cannot read dataset {name} ({detail[:300]}); check that its files are JSON Lines, "
            "JSON, Parquet, CSV or Arrow as their names say"
        ) from None


def _files_fingerprint(path: Path) -> str:
    """16 hex digits of sha256 over each data file's name (relative to ``path``), size and first
    and last :data:`_FINGERPRINT_BYTES` bytes: bounded work, whatever the dataset's size."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [f for f in files if f.resolve().is_relative_to(path)]  # never read from outside
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


def _column_kinds(dataset: Any, name: str) -> dict[str, str] | None:
    """Each column's type in words, from the features, else (a streamed file, a generator: known
    once read) from the first row; ``None`` for a dataset whose first row is not there."""
    if dataset.features is not None:
        return {k: getattr(v, "dtype", None) or str(v) for k, v in dataset.features.items()}
    with _read_errors(name), _quiet():
        first = next(iter(dataset.take(1)), None)
    if first is None:
        return None  # no rows: said when they are read
    return {k: "string" if isinstance(v, str) else type(v).__name__ for k, v in first.items()}


def _choose_column(dataset: Any, column: str | None, name: str) -> str:
    kinds = _column_kinds(dataset, name)
    if kinds is None:
        return "text" if column is None else column
    strings = [k for k, kind in kinds.items() if kind in ("string", "large_string")]
    listed = ", ".join(kinds) or "none"
    if column is not None:
        if column not in kinds:
            raise DataError(
                f"dataset {name} has no column {column!r}; its columns: {listed} "
                "(column= chooses one)"
            )
        if column not in strings:
            raise DataError(
                f"column {column!r} of dataset {name} is {kinds[column]}, not text; "
                f"choose a text column: {', '.join(strings) or 'it has none'}"
            )
        return column
    if "text" in strings:
        return "text"
    if "text" in kinds and len(strings) != 1:
        raise DataError(
            f"column 'text' of dataset {name} is {kinds['text']}, not text; choose a text "
            f"column with column=: {', '.join(strings) or 'it has none'}"
        )
    if len(strings) == 1:
        return strings[0]
    what = "several text columns" if strings else "no text column"
    raise DataError(f"dataset {name} has {what} ({listed}); choose one with column=")


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
    return TextSource(
        lambda: iter([_rows(dataset, column, name)]),
        description,
        record,
        rows=lambda: _row_texts(dataset, column, name),
    )


def _row_texts(dataset: Any, column: str, name: str) -> Iterator[str]:
    """The non-empty values of ``column`` one by one, each batch read with ``datasets`` quiet."""
    batches = _batches(dataset, column, name)
    while True:
        with _read_errors(name), _quiet():
            values = next(batches, None)
        if values is None:
            return
        yield from values


def _rows(dataset: Any, column: str, name: str) -> Iterator[str]:
    """The text of ``column``, rows joined by :data:`ROW_SEPARATOR`, in chunks of about
    :data:`CHUNK_CHARS` characters (a longer row is one chunk), each read with ``datasets``
    quiet: memory follows the bytes read, and reading stops where the caller stops. At most
    :data:`~headsurgeon.inputs.MAX_TEXT_BYTES` characters."""
    batches = _batches(dataset, column, name)
    total, more = 0, True
    while more:
        chunk: list[str] = []
        size = 0
        with _read_errors(name), _quiet():  # once a chunk: entering it costs tens of us
            while more and size < CHUNK_CHARS:
                values = next(batches, None)
                more = values is not None
                for value in values or ():
                    chunk.extend((ROW_SEPARATOR, value) if total or chunk else (value,))
                    size += len(value) + len(ROW_SEPARATOR)
        total += size
        if total > MAX_TEXT_BYTES:
            raise DataError(
                f"dataset {name} holds more than {MAX_TEXT_BYTES >> 30} GiB of text; sample "
                "it with n_seqs=, or give a part of it "
                "(dataset.take(n) or .select(range(n)))"
            )
        if chunk:
            yield "".join(chunk)


def _batches(dataset: Any, column: str, name: str) -> Iterator[list[str]]:
    """The non-empty values of ``column``, :data:`BATCH_ROWS` rows at a time; one line for a
    value that is not text, and at the end for a dataset with no rows or no text."""
    known = dataset.column_names
    if known is not None and column not in known:
        raise DataError(
            f"dataset {name} has no column {column!r}; its columns: {', '.join(known)} "
            "(column= chooses one)"
        )
    rows = dataset if known is None else dataset.select_columns([column])
    seen: set[str] = set()
    n_rows = n_texts = 0
    for batch in rows.iter(batch_size=BATCH_ROWS):
        seen.update(batch)
        if column not in seen:  # a streamed file's columns are known once its rows are
            raise DataError(
                f"dataset {name} has no column {column!r}; its columns: "
                f"{', '.join(sorted(seen))} (column= chooses one)"
            )
        values = batch[column]
        bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
        if bad is not None:
            raise DataError(
                f"column {column!r} of dataset {name} holds {type(bad).__name__} values, not "
                "text; choose a text column with column="
            )
        texts = [v for v in values if v]
        n_rows, n_texts = n_rows + len(values), n_texts + len(texts)
        yield texts
    if not n_rows:
        raise DataError(f"dataset {name} has no rows; give a dataset with rows")
    if not n_texts:
        raise DataError(
            f"dataset {name} has no text in column {column!r} (its {n_rows} rows are empty); "
            "give a dataset with text"
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
