"""``python -m headsurgeon.repair`` (also ``headsurgeon-repair``): surgical repair, with a report.

Parses the options, runs :func:`headsurgeon.repair.repair` with the model's recommended
fine-tuning settings (:func:`~headsurgeon.repair.recommended_config`), keeping finished passes in
``<out>.partial/`` for ``--resume``, and writes :func:`headsurgeon.reports.write_report` on rank 0
(``--help`` lists the options). Runs data-parallel under ``torchrun``.

Exports: main(argv) (the tool; returns its exit status), entry() (the console script: ``run(main)``)
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from headsurgeon.classify import Thresholds
from headsurgeon.cli import add_data_args, add_model_args, add_output_args, figure_formats, run
from headsurgeon.data import read_texts
from headsurgeon.errors import (
    CheckpointError,
    HeadsurgeonError,
    InvalidArgumentError,
    OutputExistsError,
)
from headsurgeon.finetune import FinetuneConfig, setup_distributed
from headsurgeon.loading import load_model
from headsurgeon.outputs import check_output_dir
from headsurgeon.repair import DRIFT_THRESHOLD, RUN_FILE, recommended_config, repair
from headsurgeon.reports import default_out_dir, partial_dir, write_report
from headsurgeon.surgery import INITS, HeadSet

__all__ = [
    "main",
    "entry",
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m headsurgeon.repair",
        description="Surgical repair of dead and BOS-sink heads: census, re-initialise the "
        "chosen heads, fine-tune only their slices, census again; repeat on the heads still "
        "sick. Runs data-parallel under torchrun.",
    )
    add_model_args(parser)
    add_data_args(parser)  # the census data, as in the classify CLI
    census = parser.add_argument_group("census and classification")
    census.add_argument("--min-query-pos", type=int, default=1, help="first query row averaged")
    defaults = Thresholds()
    census.add_argument("--sink-threshold", type=float, default=defaults.sink)
    census.add_argument("--dead-threshold", type=float, default=defaults.dead)
    census.add_argument("--min-output-share", type=float, default=defaults.min_output_share)
    surgery = parser.add_argument_group("surgery")
    surgery.add_argument("--heads", help="heads to repair, e.g. L5H9,L6H10-15 (default: census)")
    surgery.add_argument("--include", help="heads to add to pass 1 even if healthy, e.g. L5-22H5")
    surgery.add_argument("--passes", type=int, default=2, help="most passes (default 2)")
    surgery.add_argument("--init", choices=INITS, default="xavier_normal")
    surgery.add_argument("--drift-threshold", type=float, default=DRIFT_THRESHOLD)
    training = parser.add_argument_group("fine-tuning")
    ft = FinetuneConfig()
    training.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE",
        help="training text (default: the bundled training corpora)",
    )
    training.add_argument(
        "--eval-corpus",
        nargs="+",
        metavar="FILE",
        help="held-out text (default: the bundled held-out corpora)",
    )
    training.add_argument(
        "--train-seq-len",
        type=int,
        help="tokens per training sequence (default: training length, <= 512)",
    )
    training.add_argument("--n-eval-seqs", type=int, default=32)
    training.add_argument(
        "--steps",
        type=int,
        help=f"steps per pass (default: the model's recommended setting, else {ft.steps})",
    )
    training.add_argument(
        "--lr", type=float, help=f"peak learning rate (default: as --steps, else {ft.lr})"
    )
    training.add_argument("--weight-decay", type=float, default=ft.weight_decay)
    training.add_argument("--warmup", type=int, help="warm-up steps (default min(100, steps/4))")
    training.add_argument("--batch-size", type=int, default=ft.batch_size, help="per process")
    training.add_argument("--grad-accum", type=int, default=ft.grad_accum)
    training.add_argument("--max-grad-norm", type=float, default=ft.max_grad_norm)
    training.add_argument(
        "--autocast",
        choices=["bfloat16"],
        help="compute a float32 model in bfloat16 autocast (the paper's setup)",
    )
    training.add_argument("--eval-every", type=int, help="steps between evaluations")
    training.add_argument("--patience", type=int, help="early stop after N worse evaluations")
    training.add_argument("--strategy", choices=["slices", "mask"], default=ft.strategy)
    training.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--save-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the repaired model/ (default: the dtype of the checkpoint it came from); "
        "the trained slices are rounded to it before the final census",
    )
    add_output_args(parser)
    parser.add_argument("--resume", metavar="DIR",
                        help="continue the interrupted run whose --out was DIR")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _texts(paths: Sequence[str] | None) -> list[str] | None:
    return read_texts(paths) if paths else None


def _prepare_output(args: argparse.Namespace) -> Path:
    """The output folder, checked before the long run; clears a stale run on --overwrite."""
    out = Path(args.resume or args.out or default_out_dir(args.model, "repaired"))
    partial = partial_dir(out)
    check_output_dir(out, args.overwrite)
    if args.resume and not (partial / RUN_FILE).exists():
        raise CheckpointError(f"no interrupted run to resume: {partial} has no {RUN_FILE}")
    if not args.resume and partial.exists():
        if not args.overwrite:
            raise OutputExistsError(
                f"{partial} holds an interrupted run; continue it with --resume {out}, or pass "
                "--overwrite to start over"
            )
        shutil.rmtree(partial)
    return out


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 only; its result, or its error, reaches every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except HeadsurgeonError as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise InvalidArgumentError("--resume DIR continues the run writing DIR; drop --out")
    formats = figure_formats(args)  # --format pdf without a browser: fail before any training
    config = FinetuneConfig(
        steps=FinetuneConfig.steps if args.steps is None else args.steps,
        lr=FinetuneConfig.lr if args.lr is None else args.lr,
        weight_decay=args.weight_decay, warmup_steps=args.warmup,
        batch_size=args.batch_size, grad_accum=args.grad_accum,
        max_grad_norm=args.max_grad_norm, autocast=args.autocast, eval_every=args.eval_every,
        patience=args.patience, min_query_pos=args.min_query_pos, strategy=args.strategy,
        seed=args.seed,
    ).validate()  # fmt: skip
    thresholds = Thresholds(args.sink_threshold, args.dead_threshold, args.min_output_share)
    dist_info = setup_distributed(args.device)
    try:
        out = _on_rank0(lambda: _prepare_output(args))  # one decision, before any rank writes
        partial = partial_dir(out)
        model = load_model(args.model, dtype=args.dtype, device=dist_info.device)
        config = recommended_config(model, config, steps=args.steps, lr=args.lr)
        result = repair(
            model,
            _texts(args.corpus),
            eval_corpus=_texts(args.eval_corpus),
            heads=HeadSet.parse(args.heads, model) if args.heads is not None else None,
            include=HeadSet.parse(args.include, model) if args.include is not None else None,
            passes=args.passes,
            finetune_config=config,
            init=args.init,
            seed=args.seed,
            thresholds=thresholds,
            census_data=_texts(args.texts),
            census_seq_len=args.seq_len,
            census_n_seqs=args.n_seqs,
            min_query_pos=args.min_query_pos,
            prepend_bos=args.prepend_bos,
            train_seq_len=args.train_seq_len,
            n_eval_seqs=args.n_eval_seqs,
            drift_threshold=args.drift_threshold,
            save_dtype=args.save_dtype,
            work_dir=partial,
            resume=bool(args.resume),
            progress=not args.quiet,
        )
        if dist_info.rank == 0:
            write_report(result, out, formats=formats, overwrite=args.overwrite)
            shutil.rmtree(partial, ignore_errors=True)
            print((out / "report.md").read_text().split("## Pass")[0].rstrip())
            print(f"\nwrote {out}/: report.md, report.json, censuses, figures, model/")
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def entry() -> None:
    """The console script ``headsurgeon-repair`` and ``python -m headsurgeon.repair``."""
    run(main)


if __name__ == "__main__":
    entry()
