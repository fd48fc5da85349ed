"""Benchmark: the sink-cache test (``headsurgeon.sink_cache_effect``) at long lengths.

The issue's goal: ``organism`` at 16,384 tokens, 6 cache configurations (sinks 0, 1, 4 x two
windows), in under 10 minutes on the project's CPU machine. This script times, in this process
with ``--threads`` torch threads:

* ``sweep``     the perplexity sweep: the full-context reference (the model's own blocked pass,
                T²/2 attention entries per head) and one pass per cache, each block of queries
                against only the keys its cache holds (``heads=[]``); each pass's seconds
                from the library's debug log;
* ``per head``  the per-head test on the first ``--head-seq-len`` tokens, with the largest sinks
                and smallest window (one pass per head, plus the base and that cache's
                own short sweep), if ``--per-head``.

Peak memory: the kernel's high-water mark of resident memory (``VmHWM``) after each part. The
markdown report (``--out``) gives the command, machine (CPU count, load average at start and
end: the numbers are only as good as the machine was idle), times, the by_cache table and the
top of by_head; ``.json`` beside it the same as data.

    python analyses/benchmarks/sink_cache.py                       # organism, 16,384 tokens
    python analyses/benchmarks/sink_cache.py --model organism-injured --seq-len 4096 --per-head
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import headsurgeon as hs  # noqa: E402
from headsurgeon.data import to_sequences  # noqa: E402

logger = logging.getLogger("sink_cache_benchmark")


def peak_gib() -> float:
    """The process's high-water mark of resident memory (GiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="organism")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 1, 4])
    parser.add_argument("--windows", type=int, nargs="+", default=None)
    parser.add_argument("--per-head", action="store_true")
    parser.add_argument("--head-seq-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "figures/benchmarks/sink_cache.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    model = hs.load_model(args.model)
    tokens = to_sequences(model, None, seq_len=args.seq_len, n_seqs=1).tokens
    passes: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            passes.append(record.getMessage())

    library = logging.getLogger("headsurgeon.sink_cache")
    library.setLevel(logging.DEBUG)
    library.addHandler(Collect())
    times, memory = {}, {}
    start = time.perf_counter()
    effect = hs.sink_cache_effect(
        model, tokens, sinks=args.sinks, windows=args.windows, heads=[], progress=True
    )
    times["sweep"] = time.perf_counter() - start
    memory["sweep"] = peak_gib()
    logger.info("sweep: %.1f s\n%s", times["sweep"], effect.by_cache.to_string())
    by_head = None
    if args.per_head:
        # At head_seq_len, with the head cache's own sweep only (short: cheap).
        head_x, head_y = max(args.sinks), min(effect.by_cache["window"])
        start = time.perf_counter()
        by_head = hs.sink_cache_effect(
            model,
            tokens[:, : args.head_seq_len],
            sinks=[head_x],
            windows=[head_y],
            head_seq_len=None,
        ).by_head
        times["per head"] = time.perf_counter() - start
        memory["per head"] = peak_gib()
        logger.info("per head: %.1f s\n%s", times["per head"], by_head.head(12))
    write(args, effect.by_cache, by_head, times, memory, load_start, passes)


def markdown(table) -> str:
    """A DataFrame as a markdown table, numbers to 4 significant digits."""

    def cell(value) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    rows = [list(table.columns), ["---"] * len(table.columns)]
    rows += [[cell(v) for v in row] for row in table.itertuples(index=False)]
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in rows)


def write(args, by_cache, by_head, times, memory, load_start, passes) -> None:
    command = "python analyses/benchmarks/sink_cache.py " + " ".join(sys.argv[1:])
    load_end = os.getloadavg()
    n_configs = len(by_cache)
    lines = [
        "# Benchmark: sink_cache_effect",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch threads {args.threads}; load average {load_start[0]:.1f} at start, "
        f"{load_end[0]:.1f} at end (other jobs shared the CPUs). Date: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Model `{args.model}`, one sequence of {by_cache.attrs['seq_len']} held-out tokens, "
        f"{n_configs} caches (sinks {args.sinks} x windows "
        f"{sorted(set(by_cache['window']))}).",
        "",
        "| part | seconds | peak RSS (GiB) |",
        "|---|---|---|",
    ]
    for part, seconds in times.items():
        peak = memory.get(part, float("nan"))
        lines.append(f"| {part} | {seconds:.1f} | {peak:.2f} |")
    goal = times["sweep"] / 60
    lines += [
        "",
        f"Sweep (reference + {n_configs} caches): {goal:.1f} minutes "
        f"({'within' if goal < 10 else 'beyond'} the 10-minute goal).",
        "",
        "Each pass (the library's debug log):",
        "",
        *[f"- {line}" for line in passes],
        "",
        markdown(by_cache),
    ]
    if by_head is not None:
        lines += ["", "Per head, top 12:", "", markdown(by_head.head(12))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    record = {
        "command": command,
        "times": times,
        "passes": passes,
        "peak_gib": memory,
        "load_average": [load_start[0], load_end[0]],
        "by_cache": by_cache.to_dict("records"),
        "by_head": None if by_head is None else by_head.to_dict("records"),
    }
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
