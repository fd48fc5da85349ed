"""The command-line tools, and the pieces they share.

Tools (each a ``main(argv)`` and an ``entry()`` that runs it through :func:`run`):
    headsurgeon.cli.classify    ``python -m headsurgeon.classify``, ``headsurgeon-classify``
    headsurgeon.cli.blindness   ``python -m headsurgeon.blindness``, ``headsurgeon-blindness``
    headsurgeon.cli.repair      ``python -m headsurgeon.repair``, ``headsurgeon-repair``

The library modules never import this package; ``python -m headsurgeon.<tool>`` runs the
library module, whose ``__main__`` block hands over to ``headsurgeon.cli.<tool>``.

Exports:
    add_model_args(parser)    MODEL, --dtype, --device, --threads
    add_data_args(parser)     --texts, --n-seqs, --seq-len, --prepend-bos/--no-prepend-bos
    add_output_args(parser)   --out, --overwrite, --format
    figure_formats(args)      the figure formats to write; --format svg/pdf without a browser
                              is a one-line error here, before any model is loaded
    load_model_from_args(a)   the model MODEL, --dtype and --device describe
    load_data(model, args)    the token sequences the data options describe
    run(main)                 call main(argv); turn HeadsurgeonError into one line and exit code 2
                              (and keep freed memory, see headsurgeon.allocator)

Every tool is a thin layer over the library: parse, call library functions, print, and write
through :mod:`headsurgeon.reports`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

import torch
from jaxtyping import Int
from torch import Tensor
from transformer_lens import HookedTransformer

from headsurgeon.allocator import keep_freed_memory
from headsurgeon.data import to_sequences
from headsurgeon.errors import HeadsurgeonError
from headsurgeon.loading import DEFAULT_MODEL, load_model

__all__ = [
    "add_model_args",
    "add_data_args",
    "add_output_args",
    "figure_formats",
    "load_model_from_args",
    "load_data",
    "run",
]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"model name, bundled organism or checkpoint folder (default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps")
    parser.add_argument(
        "--threads",
        type=_positive_int,
        action=_SetThreads,
        help="CPU threads for torch (default: one per core). Use 1 when other jobs keep cores "
        "busy: threads that wait on a busy core made a repair step ~5x slower here",
    )


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


class _SetThreads(argparse.Action):
    """Set torch's intra-op thread count as soon as the flag is parsed."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        torch.set_num_threads(value)
        setattr(namespace, self.dest, value)


def add_data_args(parser: argparse.ArgumentParser, *, seq_len: int = 128, n_seqs: int = 64) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--texts",
        nargs="+",
        metavar="FILE",
        help="text files (.txt or .txt.gz); default: the bundled held-out corpora",
    )
    group.add_argument("--n-seqs", type=int, default=n_seqs, help="sequences to use")
    group.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    group.add_argument(
        "--prepend-bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="put a BOS token at position 0 (default: the model's own convention)",
    )


def add_output_args(parser: argparse.ArgumentParser, *, formats: bool = True) -> None:
    parser.add_argument("--out", help="output folder (default: a new folder named after the model)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an output folder that holds files"
    )
    if formats:
        parser.add_argument(
            "--format",
            nargs="+",
            choices=["svg", "pdf"],
            default=[],
            help="static figure formats besides html and png (these need Chromium: without "
            "one --format is an error, while png is skipped with a warning)",
        )


def figure_formats(args: argparse.Namespace) -> list[str] | None:
    """The ``formats`` a CLI passes to its writer, checked before any work.

    Without ``--format``: ``None``, the writers' default (html, and png when a Chromium browser
    is found; otherwise the PNGs are skipped with one warning and the run still succeeds). With
    ``--format svg pdf``: html, png and those, all required, so a missing browser is a one-line
    :class:`~headsurgeon.errors.FigureExportError` now rather than after the model has run.
    """
    if not getattr(args, "format", None):
        return None
    from headsurgeon import plots

    plots.require_browser(
        f"--format {' '.join(args.format)}",
        instead="leave out --format (html figures need no browser)",
    )
    return ["html", "png", *args.format]


def load_model_from_args(args: argparse.Namespace) -> HookedTransformer:
    return load_model(args.model, dtype=args.dtype, device=args.device)


def load_data(model: HookedTransformer, args: argparse.Namespace) -> Int[Tensor, "batch pos"]:
    return to_sequences(
        model,
        args.texts,
        seq_len=args.seq_len,
        n_seqs=args.n_seqs,
        prepend_bos=args.prepend_bos,
    )


def run(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None):
    """Run a CLI ``main``: user errors become ``error: <one line>`` on stderr and exit code 2."""
    # Our progress messages at INFO; other libraries' (kaleido, choreographer) only when they warn.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("headsurgeon").setLevel(logging.INFO)
    if os.environ.get("HEADSURGEON_KEEP_FREED_MEMORY", "1") != "0":
        keep_freed_memory()
    try:
        code = main(argv)
    except HeadsurgeonError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
