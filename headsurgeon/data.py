"""Corpora and batching: text in, fixed-length token sequences out.

Data is a ``str`` (always text, even one that names a file), an ``os.PathLike`` such as
``pathlib.Path`` (always a file to read), a list mixing the two, any other iterable of them (a
generator: read lazily), a ``datasets.Dataset`` or ``IterableDataset`` (its rows joined into
one corpus, streamed), a :class:`~headsurgeon.corpus_sources.TextSource`
(:func:`~headsurgeon.corpus_sources.load_dataset_texts`), a token tensor (a numpy array of
integers too), or :class:`Sequences` made before (used as they are, checked again).

One BOS rule for every model: a token tensor is used exactly as given, never given a BOS
token (``prepend_bos=True`` with a tensor only checks that its rows already start with one).
Sequences cut from texts follow the model's own convention (``model.cfg.default_prepend_bos``;
BLOOM and the bundled organisms prepend no BOS token) unless ``prepend_bos`` overrides it. A model
without a tokenizer has no known BOS id, so its texts are never given one either.

>>> sorted(CORPORA)
['python-docs', 'shakespeare']
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from headsurgeon.backend import Model
from headsurgeon.corpus_sources import TextSource, text_source
from headsurgeon.errors import DataError, HeadsurgeonError, InvalidArgumentError
from headsurgeon.inputs import read_text, text_file_chunks
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.validation import check_bool, check_int

__all__ = [
    "Sequences",
    "Cut",
    "as_sequences",
    "CORPORA",
    "bundled_text",
    "encode",
    "to_sequences",
    "batches",
    "describe",
]

logger = logging.getLogger(__name__)

CORPUS_DIR = Path(__file__).parent / "corpora"
CORPORA = ("shakespeare", "python-docs")
SPLITS = ("train", "heldout")

Data = str | os.PathLike | Iterable[str | os.PathLike] | TextSource | Tensor | None

# Text is tokenised in pieces of at most this many characters, so that a 50 MB line never
# reaches the tokenizer whole (it took 10 GB, or aborted in Rust).
PIECE_CHARS = 1 << 20
# With n_seqs, windows are sampled from the first max(SAMPLE_FACTOR x the tokens asked for,
# MIN_SAMPLE_TOKENS) tokens: bundled corpora and ordinary files whole, a gzip bomb not.
SAMPLE_FACTOR = 8
MIN_SAMPLE_TOKENS = 1 << 23
# A piece ends where a run of whitespace begins after a non-space character: byte-level BPE
# pre-tokenizers (BLOOM's, MPT's, Falcon's, GPT-2's) end a word there and split the run on its
# own, so no token crosses the cut.
_CUT = re.compile(r"(?<=\S)(?=\s)")

# Modules whose frames are a verb or its decorators: a deprecation names the line above them.
_WRAPPERS = ("headsurgeon.", "torch.", "contextlib", "functools")


def bundled_text(name: str = "shakespeare", split: str = "heldout") -> str:
    """One bundled corpus split as a string (see ``headsurgeon/corpora/README.md``)."""
    if name not in CORPORA:
        raise InvalidArgumentError(f"unknown corpus {name!r}; use one of {', '.join(CORPORA)}")
    if split not in SPLITS:
        raise InvalidArgumentError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    path = CORPUS_DIR / f"{name}-{split}.txt.gz"
    if not path.exists():
        raise DataError(f"bundled corpus {path.name} is missing; reinstall headsurgeon")
    return gzip.decompress(path.read_bytes()).decode("utf-8")


def read_texts(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Read UTF-8 text files (``.gz`` decompressed); a one-line :class:`DataError` for a file
    that is missing, a folder, a FIFO, a device or anything else that is not a regular file,
    unreadable, larger than :data:`~headsurgeon.inputs.MAX_TEXT_BYTES`, binary, not UTF-8 or
    empty. Each item here is a path (a ``str`` too): this is the function that reads files."""
    if isinstance(paths, (str, os.PathLike)):  # one path, not a sequence of one-letter paths
        paths = [paths]
    if not paths:
        raise DataError("no text files given; pass at least one file")
    return [_read_text(Path(path)) for path in paths]


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise DataError(f"text file {path} is a folder; give the text files in it ({path}/*.txt)")
    # Regular files only, read in bounded chunks: a FIFO, /dev/zero or a 2 GB binary file is
    # one line, found without blocking or reading it whole.
    text = read_text(path, "text file")
    if not text.strip():
        raise DataError(f"text file {path} is empty; give a file with text in it")
    return text


def tokenize(info: ModelInfo, text: str) -> list[int]:
    """Token ids of ``text`` from the model's tokenizer (``info.tokenizer``: the checkpoint's
    own), without special tokens: markup such as ``<s>`` or ``<pad>`` in the text is text,
    tokenised as its characters, never the BOS or PAD id (BOS comes only from the BOS rule).

    Long texts are tokenised in pieces of at most :data:`PIECE_CHARS` characters, cut where
    whitespace follows a word, where byte-level BPE tokenizers (BLOOM's, MPT's, Falcon's) end a
    token anyway: the ids are those of the whole text. A stretch of :data:`PIECE_CHARS` / 2
    characters with no word followed by whitespace (one unbroken word, or one run of spaces) is
    cut where the piece ends, and the tokens at that cut may differ from the whole text's."""
    return torch.cat(list(_piece_ids(info, _slices(text)))).tolist()


def _slices(text: str) -> Iterator[str]:
    return (text[i : i + PIECE_CHARS] for i in range(0, max(len(text), 1), PIECE_CHARS))


def _pieces(chunks: Iterable[str]) -> Iterator[str]:
    """The text of ``chunks`` again, re-cut into pieces of at most :data:`PIECE_CHARS`
    characters, each (but where no word boundary exists) ending before whitespace (``_CUT``)."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        # Cut from a moving start and keep the rest once: re-slicing the rest after each piece
        # copied a long chunk once per piece (quadratic; gigabytes for rows of 1 MB).
        start = 0
        while len(buffer) - start > PIECE_CHARS:
            found = _CUT.search(buffer, start + PIECE_CHARS // 2, start + PIECE_CHARS + 1)
            cut = found.start() if found else start + PIECE_CHARS
            yield buffer[start:cut]
            start = cut
        buffer = buffer[start:]
    yield buffer


def _piece_ids(info: ModelInfo, chunks: Iterable[str]) -> Iterator[Int[Tensor, " pos"]]:
    """The token ids of the text of ``chunks``, piece by piece."""
    tokenizer = info.tokenizer
    if tokenizer is None:
        raise DataError(
            "this model has no tokenizer, so text cannot be tokenised; add its tokenizer files "
            "(tokenizer.json, tokenizer_config.json) to the model folder, or pass token tensors"
        )
    for piece in _pieces(chunks):
        ids = _token_ids(tokenizer, piece)
        # Every text becomes ids here: a tokenizer larger than the model never reaches it.
        if ids.numel() and int(ids.max()) >= info.shape.d_vocab:
            raise DataError(
                f"the tokenizer gives token ids up to {int(ids.max())}, beyond the model's "
                f"vocabulary of {info.shape.d_vocab}; give the model the tokenizer it was trained "
                "with"
            )
        yield ids


def encode(info: ModelInfo, text: str, prepend_bos: bool | None = None) -> Int[Tensor, "1 pos"]:
    """``text`` as one ``[1, pos]`` sequence: its tokens, after a BOS token when ``prepend_bos``
    (default: the model's convention, :func:`resolve_bos`), as :func:`to_sequences` cuts texts."""
    ids = tokenize(info, text)
    if resolve_bos(info, prepend_bos):
        ids = [info.bos_token_id, *ids]
    if not ids:
        raise DataError("the text has no tokens; give some text")
    return torch.tensor([ids], dtype=torch.long)


def token_strings(info: ModelInfo, tokens: Int[Tensor, " pos"]) -> list[str]:
    """Each token of a sequence as readable text: the tokenizer's decoding of that one id (``#id``
    for a model without a tokenizer), with spaces and line breaks made visible (``·``, ``⏎``)."""
    tokenizer = info.tokenizer
    ids = [int(t) for t in torch.as_tensor(tokens).flatten()]
    if tokenizer is None:
        return [f"#{i}" for i in ids]
    return [tokenizer.decode([i]).replace(" ", "·").replace("\n", "⏎") or f"#{i}" for i in ids]


@functools.lru_cache(maxsize=32)
def _token_ids(tokenizer: Any, text: str) -> Int[Tensor, " pos"]:
    # Corpora are megabytes: census, evaluation and fine-tuning re-read the same ones (never
    # modify the cached tensor). split_special_tokens: "<s>" in a corpus is text, not BOS.
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def texts_of(data: Data) -> list[str]:
    """The texts ``data`` stands for: a ``str`` is always text, an ``os.PathLike`` (such as
    ``pathlib.Path``) always a file to read; a list may mix the two. A dataset's rows are one
    text (joined by a blank line), read whole."""
    if data is None:
        return [bundled_text("shakespeare", "heldout"), bundled_text("python-docs", "heldout")]
    source = text_source(data)
    if source is not None:
        texts = ["".join(_chunks_of(part)) for part in source.read()]
        if not any(t.strip() for t in texts):
            raise DataError("the texts are empty; give text with content in it")
        return texts
    # A string that happens to name a file is still text: run_census(model, "/etc/passwd")
    # measures that string, never the file (pass Path("/etc/passwd") for the file).
    items = [data] if isinstance(data, (str, os.PathLike)) else _items(data)
    if not items:
        raise DataError("no texts given; pass at least one text or file")
    texts = [_read_text(Path(x)) if isinstance(x, os.PathLike) else x for x in items]
    if not any(t.strip() for t in texts):
        raise DataError("the texts are empty; give text with content in it")
    return texts


def _sources(data: Data) -> Iterable[str | Path | Iterator[str]]:
    """What :func:`texts_of` reads, with the files not yet read: each a text, a ``Path`` or (a
    dataset's rows) one text in pieces; a lazy source's parts are read as they are consumed."""
    if data is None:
        return texts_of(data)
    if isinstance(data, TextSource):
        return data.read()
    items = [data] if isinstance(data, (str, os.PathLike)) else _items(data)
    if not items:
        raise DataError("no texts given; pass at least one text or file")
    sources = [Path(x) if isinstance(x, os.PathLike) else x for x in items]
    if all(isinstance(x, str) and not x.strip() for x in sources):
        raise DataError("the texts are empty; give text with content in it")
    return sources


def iter_texts(data: Data) -> Iterator[Iterator[str]]:
    """The texts of :func:`texts_of`, each as consecutive pieces of at most about 1 MiB: a file
    is read (and checked as :func:`read_texts` checks it) only as far as the caller consumes
    its pieces, so a caller that needs a few megabytes of a 900 MB file never holds the rest."""
    return (_chunks_of(source) for source in _sources(data))


def iter_token_ids(info: ModelInfo, data: Data) -> Iterator[Iterator[Int[Tensor, " pos"]]]:
    """Each text of :func:`iter_texts` as its token ids (those of :func:`tokenize`), piece by
    piece: read and tokenised only as far as the caller consumes them."""
    return (_piece_ids(info, chunks) for chunks in iter_texts(data))


def _chunks_of(source: str | Path | Iterator[str]) -> Iterator[str]:
    if isinstance(source, str):
        return _slices(source)
    return text_file_chunks(source) if isinstance(source, Path) else source


def _items(data: object) -> list[str | os.PathLike]:
    """The texts and files of a sequence; one line for anything else."""
    items = list(data) if isinstance(data, Iterable) else [data]
    if isinstance(data, Mapping) or not all(isinstance(x, (str, os.PathLike)) for x in items):
        raise DataError(
            f"data must be texts, text files or a token tensor; got {type(data).__name__} "
            f"holding {', '.join(sorted({type(x).__name__ for x in items}))}"
        )
    return items


def check_token_ids(info: ModelInfo, tokens: object) -> Int[Tensor, "batch pos"]:
    """``tokens`` as a ``long`` tensor if it is a non-empty ``[batch, pos]`` tensor of ids.

    Any integer dtype (``uint8``, ``int16``, ``int32``...) and any strided layout (a transposed
    or sliced view) is taken, as a contiguous ``long`` copy. Float or bool tensors are refused
    rather than cast (``torch.rand`` would become all zeros), sparse and meta tensors too, and
    every id must lie in the model's vocabulary. :class:`Sequences` and numpy arrays are checked
    by :func:`check_data` (the same checks), and their tokens returned.
    """
    if isinstance(tokens, Sequences | np.ndarray):
        checked = check_data(info, tokens)
        return checked.tokens if isinstance(checked, Sequences) else checked
    if not isinstance(tokens, Tensor):
        raise DataError(f"expected a token tensor, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise DataError(
            f"a token tensor holds integer token ids, got dtype {tokens.dtype}; tokenise text "
            "with the model's tokenizer (model.to_tokens) or pass the texts themselves"
        )
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise DataError(
            f"token tensor must be [n_seqs, seq_len], non-empty; got {tuple(tokens.shape)}"
        )
    if tokens.is_meta or tokens.layout != torch.strided:
        # A meta tensor has no values to check or run (torch would raise deep inside).
        where = "on the meta device" if tokens.is_meta else f"of layout {tokens.layout}"
        raise DataError(
            f"a token tensor {where} holds no token ids to use; pass a dense tensor on the CPU "
            "or the model's device (e.g. tokens.to('cpu') after filling it)"
        )
    # Compared in int64: in a uint8 tensor "max >= 4096" wraps and refused valid ids. Any
    # layout is used (TransformerLens needs contiguous rows).
    tokens = tokens.to(torch.long).contiguous()
    d_vocab = info.shape.d_vocab
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= d_vocab:
        row, position = ((tokens < 0) | (tokens >= d_vocab)).nonzero()[0].tolist()
        raise DataError(
            f"token ids must lie in 0..{d_vocab - 1}, got {low}..{high}; id "
            f"{int(tokens[row, position])} (row {row}, position {position}) is not in this "
            f"model's vocabulary of {d_vocab}: tokenise with this model's tokenizer"
        )
    return tokens


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Token sequences checked for one model, and where they came from: what every verb works on.

    Made by :func:`to_sequences` (or at a verb's door); used as they are by every verb of the
    same model (checked again: see below). ``len(seqs)`` rows; ``seqs[:8]``, ``seqs[2:5]``,
    ``seqs[[0, 3]]``, ``seqs[i]`` (one row) are ``Sequences`` of the same provenance.

    ``tokens``: the ``[n_seqs, seq_len]`` ids (``long``, within the vocabulary, no longer than
    the model takes). ``source``: where they came from, in words, for run metadata (the files,
    "2 text(s) given in memory", "token tensor of shape [4, 16]"; never a text's contents).
    ``holds_bos``: every row starts with the model's BOS token. ``bos_rule``: the rule that put
    position 0 there, in words. ``from_tensor``: the tokens were given as a tensor (used exactly
    as given) rather than cut from texts here. ``checked_for``: the model facts they were
    checked against (vocabulary, length limit, BOS id); another model re-checks them.
    ``dataset``: for texts from a dataset, its ``name``, ``split``, ``column`` and ``revision``
    (:mod:`headsurgeon.corpus_sources`; ``source`` says the same in words), else ``None``.

    Every verb checks them again at its door (:func:`check_data`): their tokens as any token
    tensor is checked, and against the fingerprint taken when they were made, so tokens edited
    in place (or a field set) after that are refused in one line, never run as what ``source``
    says they are. ``dataclasses.replace(seqs, tokens=...)`` makes new ones, checked likewise.
    """

    tokens: Int[Tensor, "batch pos"]
    source: str
    holds_bos: bool
    bos_rule: str
    from_tensor: bool
    checked_for: tuple[int, int | None, int | None]
    dataset: Mapping[str, str | None] | None = None
    # What the fields held when made (_fingerprint); never compared, shown or given.
    fingerprint: str = dataclasses.field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fingerprint", _fingerprint(self))

    @property
    def n_seqs(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def __repr__(self) -> str:
        return (
            f"Sequences({self.n_seqs} x {self.seq_len} tokens from {self.source}; {self.bos_rule})"
        )

    def __len__(self) -> int:
        return self.n_seqs

    def __getitem__(self, rows: int | slice | Sequence[int] | Tensor | np.ndarray) -> Sequences:
        """Some rows, with the same provenance (``seqs[i]``: the one-row ``Sequences``)."""
        if isinstance(rows, slice):
            tokens = self.tokens[rows]
        elif isinstance(rows, int | np.integer):
            if not -self.n_seqs <= rows < self.n_seqs:
                raise IndexError(f"row {rows} of {self.n_seqs} sequences")
            tokens = self.tokens[[int(rows)]]
        else:
            index = None if isinstance(rows, tuple) else torch.as_tensor(rows)
            if index is None or index.ndim != 1 or index.is_floating_point() or index.is_complex():
                raise InvalidArgumentError(
                    f"Sequences are indexed by rows: a slice, an int or a list of ints, not "
                    f"{rows!r}; to cut positions make new ones, hs.to_sequences(model, tokens)"
                )
            tokens = self.tokens[index]
        if not len(tokens):
            raise InvalidArgumentError(f"{rows!r} selects none of the {self.n_seqs} sequences")
        return dataclasses.replace(self, tokens=tokens)


def _checked_for(info: ModelInfo) -> tuple[int, int | None, int | None]:
    return info.shape.d_vocab, info.max_length, info.bos_token_id


def tokens_digest(tokens: Tensor) -> str:
    """A short sha256 digest of a token tensor's shape, dtype and every value.

    >>> rows = torch.arange(6).view(2, 3)
    >>> same, rotated = rows.clone(), rows.flip(0)
    >>> tokens_digest(rows) == tokens_digest(same), tokens_digest(rows) == tokens_digest(rotated)
    (True, False)
    """
    digest = hashlib.sha256(f"{tuple(tokens.shape)}{tokens.dtype}".encode())
    digest.update(tokens.detach().contiguous().cpu().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def _fingerprint(seqs: Sequences) -> str:
    """The digest of every field of ``seqs``; empty when its tokens are no readable tensor (the
    door refuses those for what they are)."""
    tokens = seqs.tokens
    if not isinstance(tokens, Tensor) or tokens.is_meta or tokens.layout != torch.strided:
        return ""
    dataset = None if seqs.dataset is None else sorted(dict(seqs.dataset).items())
    fields = (seqs.source, seqs.holds_bos, seqs.bos_rule, seqs.from_tensor, seqs.checked_for)
    return tokens_digest(tokens) + repr((*fields, dataset))


def check_data(info: ModelInfo, data: Any) -> Any:
    """``data`` checked at a verb's door for the model ``info`` describes, before any forward:
    the one check every verb makes. A token tensor is :func:`check_token_ids`'s (returned as
    a ``long`` tensor), a numpy array of integers the same (as a tensor; other numpy dtypes are
    refused by name), and :class:`Sequences` are checked again, never trusted: their tokens as a
    tensor's, then against the fingerprint taken when they were made (an in-place edit of the
    tokens, or a field set since, is refused) and their ``holds_bos`` against their tokens.
    Texts, files and datasets are returned as they are: their ids come from the model's own
    tokenizer, checked against the vocabulary as they are cut.
    """
    if isinstance(data, np.ndarray):
        if data.dtype.kind not in "iu":
            raise DataError(
                f"a numpy array of token ids holds integers, got dtype {data.dtype}; tokenise "
                "text with the model's tokenizer (model.to_tokens) or pass the texts themselves"
            )
        data = torch.from_numpy(np.ascontiguousarray(data))
    if isinstance(data, Tensor):
        return check_token_ids(info, data)
    if not isinstance(data, Sequences):
        return data
    if not isinstance(data.tokens, Tensor):
        raise DataError(
            f"Sequences hold a token tensor, got {type(data.tokens).__name__}; make them with "
            "hs.to_sequences(model, data)"
        )
    tokens = check_token_ids(info, data.tokens)
    if data.fingerprint != _fingerprint(data):
        raise DataError(
            "these Sequences were changed after they were made (their tokens edited in place, or "
            "a field set), so they no longer are what their source says; to use the edited "
            "tokens, make new ones: hs.to_sequences(model, seqs.tokens)"
        )
    bos = info.bos_token_id
    # Only a claim of BOS can mislead (a verb then adds none); made for another model, the
    # record is re-made from its tokens for this one anyway.
    if data.holds_bos and data.checked_for == _checked_for(info):
        if bos is None or not bool((tokens[:, 0] == bos).all()):
            raise DataError(
                f"these Sequences say holds_bos=True, but their rows do not all start with the "
                f"BOS token (id {bos}); make them with hs.to_sequences(model, seqs.tokens) "
                "rather than setting fields"
            )
    return data if tokens is data.tokens else dataclasses.replace(data, tokens=tokens)


def to_sequences(
    model: Model,
    data: Data | Sequences = None,
    *,
    seq_len: int = 128,
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> Sequences:
    """Cut texts (default: the bundled held-out corpora) into checked :class:`Sequences`: the
    one place data is cut. Verbs take the result whole, so one sample serves many measurements:
    ``seqs = hs.to_sequences(model, seq_len=256, n_seqs=32)``, then ``hs.run_census(model,
    seqs)`` and ``hs.perplexity(model, seqs[:8])``.

    ``data``: a ``str`` is always the text itself (even one that names an existing file); an
    ``os.PathLike`` (``pathlib.Path``) is a UTF-8 text file (``.gz`` decompressed), read and
    checked (:func:`read_texts`); a list may mix the two. Or a token tensor, or
    :class:`Sequences` made before.

    Each text is tokenised on its own and cut into non-overlapping windows of ``seq_len`` tokens
    (``seq_len - 1`` text tokens after a BOS token when ``prepend_bos``, by default the model's
    convention). With ``n_seqs`` the windows are taken evenly spaced over all texts (their first
    ``max(8 x n_seqs x seq_len, 2**23)`` tokens; a dataset is read from its start only until
    ``n_seqs`` windows exist), with a warning when the texts hold fewer.

    A token tensor is checked (:func:`check_token_ids`) and used exactly as given (its first
    ``n_seqs`` rows; ``seq_len`` does not apply); ``prepend_bos=True`` with rows that do not
    all start with the BOS token is refused in one line rather than changing the tensor.
    """
    info = model_info(model, "to_sequences")
    return as_sequences(info, data, seq_len=seq_len, n_seqs=n_seqs, prepend_bos=prepend_bos)


@dataclasses.dataclass(frozen=True)
class Cut:
    """How a verb cuts texts (:data:`headsurgeon.census.CENSUS_CUT`...): ``n_seqs`` windows
    (``None``: all) of ``seq_len`` tokens. Tokens and :class:`Sequences` are used whole."""

    seq_len: int
    n_seqs: int | None = None


def verb_sequences(
    info: ModelInfo,
    data: Data | Sequences,
    verb: str,
    cut: Cut,
    seq_len: int | None = None,
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
    warn: bool = True,
) -> Sequences:
    """The :class:`Sequences` ``verb`` works on: texts cut by ``cut``, tokens and
    :class:`Sequences` whole. ``seq_len``, ``n_seqs``, ``prepend_bos``: the verb's deprecated
    copies of :func:`to_sequences`' (``None``: not given): one ``FutureWarning`` naming that
    call (none with ``warn=False``), then used as before (``n_seqs`` takes the first rows)."""
    given = {"seq_len": seq_len, "n_seqs": n_seqs, "prepend_bos": prepend_bos}
    given = {name: value for name, value in given.items() if value is not None}
    texts = not isinstance(data, Tensor | Sequences | np.ndarray)
    cutting = ({"seq_len": cut.seq_len, "n_seqs": cut.n_seqs} if texts else {}) | given
    if given and warn:
        said, instead = (", ".join(f"{k}={v!r}" for k, v in d.items()) for d in (given, cutting))
        # A FutureWarning, not a DeprecationWarning: Python and notebooks hide the latter from
        # the scripts and cells that call a verb, which are the code that has to change.
        warnings.warn(
            f"{verb}({said}) is deprecated and goes in the next release: cut the data first "
            f"and pass the result, {verb}(model, hs.to_sequences(model, data, {instead}))",
            FutureWarning,
            stacklevel=_caller_level(),
        )
    return as_sequences(info, data, **cutting)


def _caller_level() -> int:
    """The ``stacklevel`` of the user's line: the first frame outside headsurgeon and the
    decorators (torch, contextlib, functools) that wrap a verb."""
    frame, level = sys._getframe(1), 1
    while frame.f_globals.get("__name__", "").startswith(_WRAPPERS):
        frame, level = frame.f_back, level + 1
    return level


def as_sequences(
    info: ModelInfo,
    data: Data | Sequences,
    *,
    seq_len: int = 128,
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
    seq_len_name: str = "seq_len",
) -> Sequences:
    """The :class:`Sequences` of ``data`` (see :func:`to_sequences`) for the model ``info``
    describes, made and checked here once; ``Sequences`` of this model pass through (their first
    ``n_seqs`` rows). ``seq_len_name``: the caller's name for ``seq_len`` in messages."""
    bos = resolve_bos(info, prepend_bos)
    n_seqs = None if n_seqs is None else check_int(n_seqs, "n_seqs", minimum=1)
    # Checked for tensors too, where it does not apply: a bad value is never silently accepted.
    seq_len = check_int(seq_len, seq_len_name, minimum=1)
    data = check_data(info, data)  # the door: nothing unchecked goes further
    if isinstance(data, Sequences):
        if data.checked_for == _checked_for(info):
            check_length(info, data.seq_len, "the sequence length", DataError)
            return data if n_seqs is None else data[:n_seqs]
        data = data.tokens  # made for another model: checked again, as a tensor
    if isinstance(data, Tensor):
        return _tensor_sequences(info, data, n_seqs, prepend_bos)
    check_length(info, seq_len, seq_len_name, DataError)
    source = text_source(data)  # a dataset or a lazy iterable, read as the windows need it
    data = data if source is None else source
    # A dataset is streamed from its start and read only until the windows asked for exist (it
    # may be any size, and its rows any length); texts and files are sampled as _windows says.
    spread = source is None or source.record is None
    tokens = _windows(info, _sources(data), seq_len, n_seqs, bos, seq_len_name, spread)
    description = describe(data)  # after the windows: data of a wrong type is their one line
    if n_seqs is not None and len(tokens) < n_seqs:  # every tool and verb that cuts text: here
        logger.warning(
            "asked for %d sequences of %d tokens, but the text (%s) holds only %d: using those %d",
            n_seqs,
            seq_len,
            description,
            len(tokens),
            len(tokens),
        )
    why = "the model's convention" if prepend_bos is None else f"prepend_bos={prepend_bos}"
    if bos:
        rule = f"BOS token (id {info.bos_token_id}) prepended to each text window ({why})"
    else:
        rule = f"no BOS token: position 0 is the first text token ({why})"
    record = None if source is None else source.record
    return Sequences(tokens, description, bos, rule, False, _checked_for(info), record)


def _tensor_sequences(
    info: ModelInfo, data: Tensor, n_seqs: int | None, prepend_bos: bool | None
) -> Sequences:
    tokens = check_token_ids(info, data)[:n_seqs]
    check_length(info, tokens.shape[1], "the sequence length", DataError)
    bos = info.bos_token_id
    holds_bos = bos is not None and bool((tokens[:, 0] == bos).all())
    if prepend_bos and not holds_bos:
        raise DataError(
            f"prepend_bos=True, but the token tensor's rows do not all start with the BOS "
            f"token (id {bos}); a token tensor is used exactly as given: put the BOS column in "
            "it yourself, or pass the texts"
        )
    rule = "token tensor used exactly as given (no BOS token added)"
    return Sequences(tokens, describe(data), holds_bos, rule, True, _checked_for(info))


def _windows(
    info: ModelInfo,
    sources: list[str | Path],
    seq_len: int,
    n_seqs: int | None,
    bos: bool,
    name: str = "seq_len",
    spread: bool = True,
) -> Int[Tensor, "batch pos"]:
    """Each text's non-overlapping windows (after a BOS token when ``bos``), ``n_seqs`` of them
    evenly spaced over all texts, or over the first ``max(SAMPLE_FACTOR * n_seqs * seq_len,
    MIN_SAMPLE_TOKENS)`` tokens when the texts hold more: reading and tokenising stop there.
    Without ``spread`` (a dataset), reading stops as soon as ``n_seqs`` windows exist (those of
    the last piece tokenised included: the windows are spread over what was read)."""
    body = seq_len - 1 if bos else seq_len
    if body < 1:
        raise InvalidArgumentError(f"{name} must be at least 2 when a BOS token is prepended")
    budget = _budget(n_seqs, body, spread)
    blocks, n_windows = [], 0
    for source in sources:
        carry = torch.empty(0, dtype=torch.long)  # tokens after the last full window so far
        for ids in _piece_ids(info, _chunks_of(source)):
            ids = torch.cat([carry, ids])
            n = ids.numel() // body
            blocks.append(ids[: n * body].view(n, body))
            carry, n_windows = ids[n * body :], n_windows + n
            if budget is not None and n_windows * body >= budget:
                break
        if budget is not None and n_windows * body >= budget:
            break
    if not n_windows:
        raise DataError(
            f"the texts are shorter than one sequence of {seq_len} tokens; give more text or "
            f"a smaller {name} (--{name.replace('_', '-')})"
        )
    tokens = torch.cat(blocks)
    if n_seqs is not None and n_seqs < n_windows:
        tokens = tokens[torch.linspace(0, n_windows - 1, n_seqs).round().long()]
    if bos:
        tokens = torch.cat([torch.full_like(tokens[:, :1], info.bos_token_id), tokens], dim=1)
    return tokens


def _budget(n_seqs: int | None, body: int, spread: bool) -> int | None:
    """How many text tokens :func:`_windows` reads (``None``: all)."""
    if n_seqs is None:
        return None
    return max(SAMPLE_FACTOR * n_seqs * body, MIN_SAMPLE_TOKENS) if spread else n_seqs * body


def check_length(
    info: ModelInfo,
    n_pos: int,
    what: str = "sequence length",
    error: type[HeadsurgeonError] = InvalidArgumentError,
) -> int:
    """``n_pos`` if the model ``info`` describes takes sequences that long, else one ``error``
    line: models with learned or rotary positions keep their context (``info.max_length``); ALiBi
    models take any length.

    >>> from headsurgeon.loading import ModelShape, model_info, random_model
    >>> check_length(model_info(random_model(ModelShape(1, 2, 8, 9, n_ctx=16))), 10**6)
    1000000
    """
    n_pos = check_int(n_pos, what, minimum=1)
    limit = info.max_length
    if limit is not None and n_pos > limit:
        raise error(
            f"{what} {n_pos} is beyond the model's context of {limit} tokens (its "
            f"{info.shape.positional} positions end there); use a shorter one"
        )
    return n_pos


HELD_OUT = "bundled held-out corpora (shakespeare, python-docs)"


def describe(data: Data, default: str = HELD_OUT) -> str:
    """A short description of ``data`` for run metadata (``default`` when it is ``None``).

    Files (``os.PathLike`` items) are named by their file name, never their folder (outputs carry
    no machine paths); ``str`` items are texts, counted, whatever they say.

    >>> from pathlib import Path
    >>> describe(torch.zeros(2, 8)), describe(["some text", "/etc/passwd"])
    ('token tensor of shape [2, 8]', '2 text(s) given in memory')
    >>> describe([Path("/home/me/corpora/a.txt"), "more text"])
    'a.txt and 1 text(s) given in memory'
    >>> describe(None, default="bundled training corpora")
    'bundled training corpora'
    """
    if data is None:
        return default
    if isinstance(data, Sequences):
        return data.source
    if isinstance(data, Tensor):
        return f"token tensor of shape {list(data.shape)}"
    source = text_source(data)
    if source is not None:
        return source.description
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    files = [Path(x).name for x in items if isinstance(x, os.PathLike)]
    texts = len(items) - len(files)
    in_memory = f"{texts} text(s) given in memory" if texts else ""
    return " and ".join(part for part in (", ".join(files), in_memory) if part)


def resolve_bos(info: ModelInfo, prepend_bos: bool | None = None) -> bool:
    """Whether position 0 gets a BOS token: ``prepend_bos``, else the model's convention.

    The convention is ``info.prepend_bos`` (``model.cfg.default_prepend_bos``, read at each
    :func:`~headsurgeon.loading.model_info`; TransformerLens's config default is ``True``). A
    model with no known BOS id (no tokenizer) cannot follow it, so its token tensors are used as
    given; asking for a BOS token explicitly is then an error.

    >>> from headsurgeon.loading import ModelShape, model_info, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=16, n_ctx=8))
    >>> model.cfg.default_prepend_bos = True  # no tokenizer: nothing to prepend
    >>> resolve_bos(model_info(model)), resolve_bos(model_info(model), False)
    (False, False)
    """
    if prepend_bos is not None:
        prepend_bos = check_bool(prepend_bos, "prepend_bos")
    wanted = info.prepend_bos if prepend_bos is None else prepend_bos
    if not wanted or info.bos_token_id is not None:
        return wanted
    if prepend_bos:
        raise DataError(
            "prepend_bos=True, but this model has no tokenizer with a BOS token to say which id "
            "to prepend; pass token sequences that start with it and prepend_bos=False"
        )
    return False


def batches(
    tokens: Int[Tensor, "batch pos"], batch_size: int
) -> Iterator[Int[Tensor, "batch pos"]]:
    """Consecutive batches of ``batch_size`` sequences (the last one may be smaller).

    >>> [b.shape[0] for b in batches(torch.zeros(5, 3, dtype=torch.long), 2)]
    [2, 2, 1]
    """
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    for start in range(0, tokens.shape[0], batch_size):
        yield tokens[start : start + batch_size]
