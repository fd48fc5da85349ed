"""What the tools load once their options are checked: the model and the data (imports torch
and TransformerLens, so the tools import it after parsing; see :mod:`headsurgeon.cli`).
"""

from __future__ import annotations

import argparse
import logging

import torch

from headsurgeon.allocator import too_many_threads
from headsurgeon.backend import Model
from headsurgeon.cli.options import data_source, placement_args
from headsurgeon.data import Sequences, to_sequences
from headsurgeon.errors import DataError
from headsurgeon.loading import load_model, model_info

__all__ = [
    "load_data",
]

logger = logging.getLogger(__name__)


def use_threads(args: argparse.Namespace) -> None:
    """Set torch's intra-op thread count, before any work: ``--threads``; without it, torch's
    own default (one per core) lowered to the cores other jobs leave free
    (:func:`headsurgeon.allocator.too_many_threads`), with one log line naming --threads: a
    thread that waits on a busy core slows every step (a repair step ~5x on a loaded machine)."""
    if getattr(args, "threads", None) is not None:
        torch.set_num_threads(args.threads)
        return
    threads = torch.get_num_threads()
    crowded = too_many_threads(threads)
    if crowded is not None:
        free, why = crowded
        torch.set_num_threads(free)
        logger.info(
            "%s: torch uses %d thread%s, not %d (--threads N sets the count)",
            why,
            free,
            "" if free == 1 else "s",
            threads,
        )


def load_model_from_args(args: argparse.Namespace) -> Model:
    model = load_model(args.model, dtype=args.dtype, **placement_args(args))
    require_tokenizer(model, args)
    return model


def require_tokenizer(model: Model, args: argparse.Namespace, what: str = "") -> None:
    """One line for a model that cannot tokenise the tool's text (``what``, default: --texts or
    the bundled corpora): the fix is a tokenizer in its folder, as a CLI cannot pass tokens."""
    if model_info(model, "load_model").tokenizer is not None:
        return
    if not what:
        given = [f"--{o}" for o in ("texts", "dataset") if getattr(args, o, None)]
        what = given[0] if given else "the bundled text corpora"
    raise DataError(
        f"{args.model} has no tokenizer, so {what} cannot be tokenised; add the tokenizer files "
        "of the model it was trained as (tokenizer.json, tokenizer_config.json) to its folder"
    )


def load_data(model: Model, args: argparse.Namespace) -> Sequences:
    """The sequences ``--texts`` or ``--dataset``, ``--seq-len``, ``--n-seqs`` and
    ``--prepend-bos`` describe (a warning when the text holds fewer than asked for: the one of
    :func:`headsurgeon.data.as_sequences`)."""
    return to_sequences(
        model,
        data_source(args),
        seq_len=args.seq_len,
        n_seqs=args.n_seqs,
        prepend_bos=args.prepend_bos,
    )
