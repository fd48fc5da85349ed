"""The options the tools share, and their checks, importable without torch or pandas.

Each tool (``cli/classify.py``...) builds its parser from these and from the library's defaults
(:mod:`headsurgeon.defaults`), so that ``--help``, a usage error, a bad ``--texts`` file, a
missing MODEL folder, an unknown model name or an ``--out`` folder it may not write
(:func:`check_out`) is answered before torch, TransformerLens, transformers, pandas or plotly is
imported.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from headsurgeon.defaults import (
    CENSUS_N_SEQS,
    CENSUS_SEQ_LEN,
    DEAD_THRESHOLD,
    DTYPE_NAMES,
    MIN_OUTPUT_SHARE,
    SINK_THRESHOLD,
)
from headsurgeon.errors import DataError, FigureExportError, HeadsurgeonError, shown
from headsurgeon.inputs import check_texts
from headsurgeon.model_names import (
    DEFAULT_MODEL,
    ORGANISM_DIR,
    check_hub_model,
    locate_model,
    organism_names,
)
from headsurgeon.outputs import check_output_dir, claim_output, headsurgeon_version
from headsurgeon.validation import MAX_SEED

if TYPE_CHECKING:
    from headsurgeon.corpus_sources import TextSource

__all__: list[str] = []

logger = logging.getLogger(__name__)


def add_model_args(
    parser: argparse.ArgumentParser, *, dtype: bool = True, many: bool = False
) -> None:
    """MODEL (``many``: MODEL ..., a list), the device options, --threads and (unless
    ``dtype=False``: a tool that fixes it) --dtype."""
    parser.add_argument(
        "model",
        nargs="*" if many else "?",
        default=[DEFAULT_MODEL] if many else DEFAULT_MODEL,
        help=f"model name, bundled organism or checkpoint folder (default: {DEFAULT_MODEL})"
        + (
            "; several: each in turn, one in memory at a time, and their comparison" if many else ""
        ),
    )
    if dtype:
        parser.add_argument(
            "--dtype", type=dtype_name, default="float32", help="float32, bfloat16 or float16"
        )
    parser.add_argument("--device", help="cpu (default), cuda, cuda:N, mps: the whole model")
    parser.add_argument(
        "--device-map",
        type=device_map,
        help="spread the model with Hugging Face Accelerate: auto, balanced, balanced_low_0, "
        "sequential, or MODULE=DEVICE,... (devices 0, cuda:N, cpu, disk; modules as the "
        "installed TransformerLens names them: blocks.N on 3.x, transformer.h.N on 4.x)",
    )
    parser.add_argument(
        "--max-memory",
        type=max_memory,
        help="memory per device for --device-map (default auto), e.g. 0=14GiB,cpu=30GiB",
    )
    parser.add_argument(
        "--offload-folder",
        help="where weights the map puts on disk are written (a private subfolder, removed "
        "after the run; default: the system's temporary folder)",
    )
    parser.add_argument(
        "--threads",
        type=thread_count,
        help="CPU threads for torch (default: one per usable core, less the cores other jobs "
        "keep busy, at least 1; one log line says when the load lowers it): threads that wait "
        "on a busy core made a repair step ~5x slower here",
    )


def shown_default(action: argparse.Action) -> str | None:
    """An option's default as ``--help`` shows it (a list as its items, space-separated), or
    None when it has none to show (None, False, an empty list; a flag such as ``--no-control``,
    whose default is its absence)."""
    default = action.default
    # Identity, not ==: a default of 0 is shown (0 == False).
    if action.nargs == 0 or default is None or default is False or default == []:
        return None
    if default == argparse.SUPPRESS:
        return None
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default))
    return str(default)


def help_with_default(action: argparse.Action) -> str:
    """An option's help text ending with its default, unless the text names it already
    (``(default 0.3)``)."""
    text = action.help or ""
    default = shown_default(action)
    if default is None or ("default" in text and default in text):
        return text
    return f"{text} (default: {default.replace('%', '%%')})"


class _DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` with every option's default (:func:`help_with_default`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return help_with_default(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like every other error of the tools, and whose
    ``--help`` shows every option's default; ``--version`` prints what ``python -m headsurgeon
    --version`` prints.

    Options must be written in full: a prefix (``--dtype`` for ``--dtypes``) is not guessed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self._needs: list[tuple[str, str]] = []
        self.add_argument(
            "--version",
            action="version",
            version=f"headsurgeon {headsurgeon_version()}",
            help="show headsurgeon's version and exit",
        )

    def needs(self, option: str, needed: str) -> None:
        """Refuse ``option`` given without ``needed`` (``--split`` without ``--dataset``): both
        default to None, so a value of None is one not given."""
        self._needs.append((option, needed))

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        """argparse's, then: an option given without the one it ``needs``, and a value given
        twice in a list option (``--dtypes float16 fp16``, one dtype twice), are one line."""
        parsed = super().parse_args(args, namespace)
        dest = {o: a.dest for a in self._actions for o in a.option_strings}
        for option, needed in self._needs:
            if getattr(parsed, dest[option]) is not None and getattr(parsed, dest[needed]) is None:
                self.error(f"{option} applies to {needed}; give {needed} too, or drop {option}")
        for action in self._actions:
            values = getattr(parsed, action.dest, None)
            if type(action) is argparse._StoreAction and isinstance(values, list):
                _refuse_repeats(self, action, values)
        return parsed

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {shown(message, keep='')} ({self.prog} --help lists the options)\n")


def _refuse_repeats(parser: ArgumentParser, action: argparse.Action, values: list) -> None:
    """One line for a list option naming one value twice, as typed or through an alias."""
    repeated = [value for i, value in enumerate(values) if value in values[:i]]
    if not repeated or values is action.default:
        return
    name = "/".join(action.option_strings) or action.metavar or action.dest.upper()
    typed = " ".join(getattr(value, "typed", str(value)) for value in values)
    parser.error(
        f"{name} names {', '.join(dict.fromkeys(map(str, repeated)))} more than once "
        f"({typed}); give each once"
    )


class _Named(str):
    """A canonical name (``float16``) that remembers how it was typed (``fp16``)."""

    typed: str


def dtype_name(text: str) -> str:
    """An argparse ``type``: a float format by any of its names (``fp16``, ``half``), as its
    canonical one (``float16``); a name it does not know is one line."""
    canonical = DTYPE_NAMES.get(text.lower())
    if canonical is None:
        known = ", ".join(dict.fromkeys(DTYPE_NAMES.values()))
        raise argparse.ArgumentTypeError(f"unknown dtype {_shown(text)}; use one of {known}")
    named = _Named(canonical)
    named.typed = text
    return named


def _pairs(text: str, what: str) -> dict[str, str]:
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if not pairs or any(not k.strip() or not sep or not v.strip() for k, sep, v in pairs):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return {key.strip(): value.strip() for key, _, value in pairs}


def device_map(text: str) -> str | dict[str, str]:
    """An argparse ``type``: a strategy (``auto``) or ``MODULE=DEVICE,...``, checked by
    :func:`headsurgeon.placement.check_placement` at load."""
    return text if "=" not in text else _pairs(text, "auto or MODULE=DEVICE,...")


def max_memory(text: str) -> dict[str, str]:
    """An argparse ``type``: ``DEVICE=SIZE,...`` (``0=14GiB,cpu=30GiB``)."""
    return _pairs(text, "DEVICE=SIZE,... such as 0=14GiB,cpu=30GiB")


def placement_args(args: argparse.Namespace) -> dict[str, Any]:
    """``load_model``'s device arguments from --device, --device-map, --max-memory and
    --offload-folder."""
    return {
        "device": args.device,
        "device_map": args.device_map,
        "max_memory": args.max_memory,
        "offload_folder": args.offload_folder,
    }


# The most any count option takes (sequences, tokens, steps, passes, ...): 2**24, the largest
# integer float32 holds exactly (positions and distances pass through float32), and far beyond any
# run that finishes; a larger one is a typo, refused at parse, not a run that never ends.
MAX_COUNT = 2**24
# --threads beyond this many per core only queue (100000 threads crashed torch).
THREADS_PER_CORE = 4


def _int_in(text: str, minimum: int, maximum: int, kind: str, why: str = "") -> int:
    """``text`` as an int in ``[minimum, maximum]``, else an argparse error (argparse names the
    option). ASCII digits only: ``int("²")`` fails, and 20-digit counts never reach torch."""
    stripped = text.strip()
    digits = stripped[1:] if stripped.startswith("-") else stripped
    if not (digits.isascii() and digits.isdigit()):
        raise argparse.ArgumentTypeError(f"expected {kind}, got {_shown(text)}")
    # Beyond 30 digits (and int()'s 4300-digit limit) only the sign matters.
    value = int(stripped) if len(digits) < 30 else int(stripped[0] + "9" * 30)
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {_shown(text)}")
    if value > maximum:
        raise argparse.ArgumentTypeError(
            f"expected {kind} of at most {maximum}{why}, got {_shown(text)}"
        )
    return value


_COUNT_WHY = " (2**24, the most any count option takes)"


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer from 1 to :data:`MAX_COUNT`."""
    return _int_in(text, 1, MAX_COUNT, "a positive integer", _COUNT_WHY)


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer from 0 to :data:`MAX_COUNT`."""
    return _int_in(text, 0, MAX_COUNT, "an integer >= 0", _COUNT_WHY)


def seed(text: str) -> int:
    """An argparse ``type``: a seed, 0 to 2**63 - 1 (torch's 64-bit seeds)."""
    return _int_in(text, 0, MAX_SEED, "a seed >= 0")


def thread_count(text: str) -> int:
    """An argparse ``type``: 1 to :data:`THREADS_PER_CORE` x the machine's cores."""
    cores = os.cpu_count() or 1
    most = THREADS_PER_CORE * cores
    return _int_in(
        text,
        1,
        most,
        "a positive thread count",
        f" ({THREADS_PER_CORE} per core, {cores} cores here)",
    )


def add_threshold_args(group: argparse._ArgumentGroup) -> None:
    """The classification thresholds (:class:`headsurgeon.classify.Thresholds`) as options."""
    group.add_argument(
        "--sink-threshold",
        type=float,
        default=SINK_THRESHOLD,
        help="a head whose BOS mass exceeds this is a BOS-sink",
    )
    group.add_argument(
        "--dead-threshold",
        type=float,
        default=DEAD_THRESHOLD,
        help="a head whose BOS mass exceeds this is dead",
    )
    group.add_argument(
        "--min-output-share",
        type=float,
        default=MIN_OUTPUT_SHARE,
        help="heads writing less than this share of their layer's attention output are dead",
    )


def add_data_args(
    parser: argparse.ArgumentParser,
    *,
    seq_len: int = CENSUS_SEQ_LEN,
    n_seqs: int | None = CENSUS_N_SEQS,
    n_seqs_help: str = "sequences to use",
    corpora: bool = False,
    dataset: bool = True,
) -> None:
    """--texts, --n-seqs, --seq-len, --prepend-bos; ``corpora``: --texts may be repeated, each
    time one corpus (:class:`CorpusFiles`); ``dataset``: or --dataset, --split, --column
    (:func:`add_dataset_args`), one line when given with --texts."""
    group = parser.add_argument_group("data")
    source = group.add_mutually_exclusive_group()
    text_help = "UTF-8 text files (.txt or .txt.gz); default: the bundled held-out corpora"
    if corpora:
        text_help += (
            ". Repeat --texts for several corpora (--texts A.txt --texts B.txt): each its own "
            "census, and their comparison"
        )
    source.add_argument(
        "--texts",
        nargs="+",
        metavar="FILE",
        action=CorpusFiles if corpora else TextFiles,
        help=text_help,
    )
    if dataset:
        add_dataset_args(group, source, "the text")
        needs_dataset(parser)
    group.add_argument("--n-seqs", type=positive_int, default=n_seqs, help=n_seqs_help)
    group.add_argument("--seq-len", type=positive_int, default=seq_len, help="tokens per sequence")
    group.add_argument(
        "--prepend-bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="put a BOS token at position 0 (default: the model's own convention)",
    )


def add_dataset_args(
    group: argparse._ArgumentGroup, exclusive: argparse._MutuallyExclusiveGroup, what: str
) -> None:
    """``--dataset PATH_OR_NAME`` (in ``exclusive``, the group of the options it replaces),
    ``--split`` and ``--column`` (in ``group``): ``what`` read from a Hugging Face dataset."""
    exclusive.add_argument(
        "--dataset",
        type=dataset_name,
        metavar="PATH_OR_NAME",
        help=f"{what} from a Hugging Face dataset, streamed: a folder or file (JSON Lines, "
        "Parquet, CSV, Arrow, or a save_to_disk folder) or a dataset name in the datasets "
        "cache; its rows are one corpus, and its name, split, column and revision are recorded",
    )
    group.add_argument("--split", help="the dataset's split (default: train)")
    group.add_argument(
        "--column", help="the dataset's text column (default: text, else its only text column)"
    )


def needs_dataset(parser: ArgumentParser) -> None:
    """--split and --column (of :func:`add_dataset_args`) refused without --dataset."""
    parser.needs("--split", "--dataset")
    parser.needs("--column", "--dataset")


def dataset_name(text: str) -> str:
    """An argparse ``type``: ``--dataset``'s value, an existing path or a dataset name
    (:func:`headsurgeon.corpus_sources.check_dataset_arg`, which imports no ``datasets``)."""
    from headsurgeon.corpus_sources import check_dataset_arg

    try:
        return check_dataset_arg(text)
    except HeadsurgeonError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class TextFiles(argparse.Action):
    """A FILE option (``nargs="+"``): the files are read and checked when parsed, before any
    model is loaded (:func:`headsurgeon.inputs.check_texts`, in bounded memory: one line for a
    file that is missing, a folder, binary, not UTF-8 or empty), and stored as ``Path`` objects,
    which the library never takes for text."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            check_texts(values)
        except DataError as e:
            raise DataError(f"{option_string}: {e}") from None
        setattr(namespace, self.dest, [Path(value) for value in values])


class CorpusFiles(TextFiles):
    """A repeatable FILE option: each occurrence is one corpus (its files checked as
    :class:`TextFiles` checks them). ``args.corpora`` holds the groups in order; ``args.<dest>``
    every file of every group (the run's inputs, which no output may touch)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        groups = [*(getattr(namespace, "corpora", None) or []), getattr(namespace, self.dest)]
        namespace.corpora = groups
        setattr(namespace, self.dest, [path for group in groups for path in group])


def add_output_args(parser: argparse.ArgumentParser, *, formats: bool = True) -> None:
    parser.add_argument(
        "--out",
        help="output folder (default: a new folder named after the model); never the working "
        "directory, home or a folder the run reads (a symlink writes its target)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an output folder headsurgeon wrote (one holding other files is refused)",
    )
    if formats:
        parser.add_argument(
            "--format",
            nargs="+",
            choices=["html", "svg", "pdf"],
            default=[],
            help="figure files besides the PNGs (written when a Chromium is found) and "
            "index.html, which holds every figure interactively: html (each figure as its own "
            "page, all sharing one plotly.js in the folder), svg, pdf (these two need Chromium: "
            "without one --format svg/pdf is an error)",
        )


def figure_formats(args: argparse.Namespace) -> list[str] | None:
    """The ``formats`` a CLI passes to its writer, checked before any work.

    Without ``--format``: ``None``, the writers' default (png when a Chromium browser is found;
    otherwise the PNGs are skipped with one warning and the run still succeeds; every figure is
    on ``index.html`` either way). With ``--format``: png (when a browser is found and starts)
    and those; svg and pdf need the browser, so a missing one, or one that does not start, is a
    one-line :class:`~headsurgeon.errors.FigureExportError` now rather than after the model has
    run. The browser is started here then (:func:`headsurgeon.plots.start_browser`), and kept.
    """
    if os.environ.get("HEADSURGEON_BROWSER_TIMEOUT", "").strip():
        from headsurgeon.plots import export

        export.start_timeout()  # a bad value: one line now, not after the census
    if not getattr(args, "format", None):
        return None
    from headsurgeon import plots

    static = [f for f in args.format if f in plots.STATIC_FORMATS]
    if static:
        plots.start_browser(
            f"--format {' '.join(static)}",
            instead="leave out --format svg/pdf (index.html holds every figure interactively)",
        )
    png = ["png"]
    try:
        plots.start_browser("writing them", instead="find every figure on index.html")
    except FigureExportError as e:
        logger.warning("no PNG figures: %s", e)
        png = []
    return list(dict.fromkeys([*png, *args.format]))


def check_models(
    args: argparse.Namespace, also: Collection[str] = (), *, files: bool = True
) -> None:
    """Each MODEL (one or several) located before any heavy import
    (:func:`headsurgeon.model_names.locate_model`): a folder that does not exist, a name that
    is neither an organism nor a TransformerLens name, or a hub model that is not in the cache
    and cannot be downloaded (:func:`headsurgeon.model_names.check_hub_model`) is one line now,
    not after seconds of imports. ``also``: more names (lower case) the tool takes without a
    folder, unless ``files`` (the run reads the model's files)."""
    models = getattr(args, "model", None) or []
    for model in map(str, models if isinstance(models, list) else [models]):
        if model.lower() in also and not files:
            continue
        official = locate_model(model)[2]
        if official is not None and files:
            check_hub_model(official)


def run_inputs(args: argparse.Namespace) -> list[Path]:
    """The files and folders a run of a tool reads, which its output must never touch.

    MODEL (each of several) when it names something on disk (a checkpoint folder), else the
    bundled organism's folder when it names one; every file of ``--texts``, ``--corpus`` and
    ``--eval-corpus``; a ``--dataset`` folder or file.
    (A hub model lives in the hub cache, which no output can reach by accident.)
    """
    inputs = []
    models = getattr(args, "model", None) or []
    for model in map(str, models if isinstance(models, list) else [models]):
        if os.path.lexists(model):
            inputs.append(Path(model))
        elif model in organism_names():
            inputs.append(ORGANISM_DIR / model)
    for option in ("texts", "corpus", "eval_corpus"):
        inputs.extend(Path(p) for p in getattr(args, option, None) or [])
    dataset = getattr(args, "dataset", None)
    if dataset and os.path.lexists(dataset):  # a dataset name lives in the datasets cache
        inputs.append(Path(dataset))
    return inputs


@contextlib.contextmanager
def claim_out(args: argparse.Namespace, default: str | os.PathLike) -> Iterator[Path]:
    """The output folder (``--out``, else ``default``), claimed for the run; yielded resolved
    (absolute, symlinks followed: :func:`headsurgeon.outputs.resolve_output`).

    Checked before any model is loaded (:func:`headsurgeon.outputs.claim_output`): a path no
    output may take (``/``, home, the working directory or a parent of it, a dangling symlink or
    a loop), one that is, holds or lies inside an input (:func:`run_inputs`), a file in the way,
    a folder holding files headsurgeon did not write (even with ``--overwrite``) or any files
    (without it), a location that cannot be created or written, or another run writing it now
    are one-line errors, and so is an ``--offload-folder`` that is or lies inside the output or an
    input; what a killed run left there (marked as ours) is cleaned. The tool
    writes inside the ``with`` block; the claim ends with it.
    """
    out = Path(args.out) if args.out else Path(default)
    inputs = run_inputs(args)
    _check_offload_folder(args, out, inputs)
    with claim_output(out, args.overwrite, inputs=inputs) as claimed:
        yield claimed


def check_out(args: argparse.Namespace) -> None:
    """``--out`` (when given) checked as :func:`claim_out` will check it, creating nothing, so
    that a refusal answers before the tool's heavy imports; the tool claims the folder later.
    (Without ``--out`` the default is a new name.)"""
    if not getattr(args, "out", None):
        return
    inputs = run_inputs(args)
    _check_offload_folder(args, Path(args.out), inputs)
    check_output_dir(args.out, args.overwrite, inputs=inputs)


def _check_offload_folder(args: argparse.Namespace, out: Path, inputs: list[Path]) -> None:
    """--offload-folder (when given) neither the output folder nor an input, nor inside one."""
    if getattr(args, "offload_folder", None):
        from headsurgeon.placement import check_offload_folder  # imports torch: only when asked

        taken = [("the output folder", out), *(("the input", path) for path in inputs)]
        check_offload_folder(args.offload_folder, taken)


def dataset_split(args: argparse.Namespace) -> str:
    """``--split``, else the dataset's ``train`` split."""
    return args.split or "train"


def data_source(args: argparse.Namespace) -> list[Path] | TextSource | None:
    """The texts ``--texts`` (the files) or ``--dataset``, ``--split``, ``--column`` (a
    :class:`~headsurgeon.corpus_sources.TextSource`) name; ``None`` for the bundled corpora."""
    if getattr(args, "dataset", None):
        from headsurgeon.corpus_sources import load_dataset_texts

        return load_dataset_texts(args.dataset, split=dataset_split(args), column=args.column)
    return args.texts
