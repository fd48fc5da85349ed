"""Benchmark: attribution patching against exact per-head ablation, time and agreement.

Both are ``headsurgeon.head_importance`` with mean ablation (``method="mean"`` and
``method="attribution"``), on the same token batches in one process, for

* a random-weight model of a BLOOM shape (default bloom-560m: 24 x 16 = 384 heads, a
  250,880-token vocabulary), on random token ids; its heads barely matter (random weights),
  so its agreement says little about a trained model;
* a bundled organism (default ``organism-injured``: 4 x 16 heads, trained), on held-out text.

Each timing includes the shared first pass that finds every head's mean ``z``; a plain forward
pass over the same batches is timed as the unit. Times are wall clock; CPU time (in the JSON
and the speed-up column) is robust to other jobs on a shared machine. Agreement: Spearman and
Pearson correlation of ``delta_loss``, and the overlap of the top tenth of heads
(``compare_importance``).

    python analyses/benchmarks/importance.py                       # the defaults, 1 thread
    python analyses/benchmarks/importance.py --shape 4x8x128 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _shapes import parse_shape

from headsurgeon import head_importance, load_model, model_info
from headsurgeon.data import to_sequences
from headsurgeon.importance import compare_importance
from headsurgeon.loading import random_model


def timed(fn):
    """``fn()``, its wall-clock seconds and its CPU seconds (the CPU time is what it costs on
    a machine that other jobs share: with one thread it excludes waiting for a core)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def bench(name: str, model, tokens: torch.Tensor, batch_size: int) -> dict:
    """Forward, exact mean ablation and attribution of it on ``tokens``: seconds and agreement."""

    def forward():
        with torch.no_grad():
            for batch in tokens.split(batch_size):
                model(batch)

    def run(method):
        return head_importance(model, tokens, method=method, batch_size=batch_size, progress=False)

    forward()  # warm-up: first-call allocations
    _, t_forward, c_forward = timed(forward)
    exact, t_exact, c_exact = timed(lambda: run("mean"))
    estimate, t_attr, c_attr = timed(lambda: run("attribution"))
    agreement = compare_importance(exact, estimate)
    row = {
        "model": name,
        "heads": len(exact),
        "tokens": f"{tokens.shape[0]} x {tokens.shape[1]}",
        "forward_s": t_forward,
        "exact_s": t_exact,
        "attribution_s": t_attr,
        "speed_up": t_exact / t_attr,
        "forward_cpu_s": c_forward,
        "exact_cpu_s": c_exact,
        "attribution_cpu_s": c_attr,
        "speed_up_cpu": c_exact / c_attr,
        **agreement,
        "max_abs_delta": float(exact["delta_loss"].abs().max()),
    }
    print(
        f"  {name}: forward {t_forward:.2f} s, exact {t_exact:.1f} s, attribution "
        f"{t_attr:.2f} s, Spearman {agreement['spearman']:.3f}",
        flush=True,
    )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | heads | tokens | forward (s) | exact mean ablation (s) | attribution (s) | "
        "speed-up (wall / CPU) | Spearman | Pearson | top-10% overlap | max abs Δ loss |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['heads']} | {r['tokens']} | {r['forward_s']:.2f} | "
            f"{r['exact_s']:.1f} | {r['attribution_s']:.2f} | "
            f"{r['speed_up']:.0f}x / {r['speed_up_cpu']:.0f}x | "
            f"{r['spearman']:.3f} | {r['pearson']:.3f} | {r['top_k_overlap']:.2f} "
            f"(k={r['k']}) | {r['max_abs_delta']:.2g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="bloom-560m", help="a BLOOM name, or e.g. 2x4x64")
    parser.add_argument("--batch-size", type=int, default=2, help="random model: sequences")
    parser.add_argument("--seq-len", type=int, default=32, help="random model: tokens each")
    parser.add_argument("--organism", default="organism-injured")
    parser.add_argument("--organism-seqs", type=int, default=16)
    parser.add_argument("--organism-seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"# head importance: {args.threads} thread(s)", flush=True)
    rows = []
    organism = load_model(args.organism)
    tokens = to_sequences(organism, seq_len=args.organism_seq_len, n_seqs=args.organism_seqs).tokens
    rows.append(bench(model_info(organism).name, organism, tokens, batch_size=8))
    del organism

    model = random_model(parse_shape(args.shape), seed=0)
    generator = torch.Generator().manual_seed(1)
    # Ids from 10 up avoid the special tokens, as in analyses/benchmarks/census.py.
    tokens = torch.randint(
        10, model.cfg.d_vocab, (args.batch_size, args.seq_len), generator=generator
    )
    rows.append(bench(f"random {args.shape}", model, tokens, batch_size=args.batch_size))

    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setup": vars(args), "results": rows, "table": text}, f, indent=2)


if __name__ == "__main__":
    main()
