"""Benchmark (TransformerLens 3.x): the census on its fused path against the fused forward and
the attention's FLOP floor (issue 54).

On ``organism`` (4 layers, 16 heads, head width 16, float32), one sequence of each ``--lengths``
tokens (the README's text), one thread, median of ``--repeats`` (one run from 8,192 tokens on):

* ``flash forward``  the forward with each attention the CPU flash kernel on ``hook_q/k/v``
                     (``fused_census_forward.flash_z``): the issue's denominator;
* ``census``         ``run_census`` with its default columns (reach too: the blocked path);
* ``fused census``   ``run_census(reach=False)``: every column but reach, the fused path;
* ``floor``          the attention's FLOPs (causal: ``2 d_head T^2`` a head, for q·k and the
                     weighted values) at this process's measured float32 matrix-product rate
                     (a 2,048-square ``torch.mm``, one thread): no attention can be faster.

Also printed: the largest difference of each fused column from the blocked census's (a check,
not a timing). Not measured: memory, TransformerLens 4.x (the fused path is 3.x only), GPUs.

    OMP_NUM_THREADS=1 python analyses/benchmarks/fused_census.py --lengths 512 2048 8192 16384
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from headsurgeon import run_census
from headsurgeon.data import to_sequences
from headsurgeon.outputs import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_census_forward import attention_by, flash_z, load_organism  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "benchmarks" / "fused_census.md"
METHODS = ("flash forward", "census", "fused census")


def matmul_rate() -> float:
    """Float32 FLOP/s of one large matrix product on this thread (best of 5)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(5))
    return 2 * 2048**3 / best


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, slopes = load_organism("fused_census.py")
    cfg = model.cfg
    text = (ROOT / "README.md").read_text() * 40
    rate = matmul_rate()
    rows = []
    for n_pos in args.lengths:
        tokens = to_sequences(model, text, seq_len=n_pos, n_seqs=1).tokens

        def flash(t=tokens):
            with torch.no_grad(), attention_by(model, slopes, flash_z):
                model(t, stop_at_layer=cfg.n_layers)

        run = {
            "flash forward": flash,
            "census": lambda t=tokens: run_census(model, t, progress=False),
            "fused census": lambda t=tokens: run_census(model, t, reach=False, progress=False),
        }
        repeats = args.repeats if n_pos < 8192 else 1
        times = {name: [] for name in METHODS}
        results = {}
        for repeat in range(repeats):
            for name in METHODS[repeat % 3 :] + METHODS[: repeat % 3]:
                start = time.perf_counter()
                results[name] = run[name]()
                times[name].append(time.perf_counter() - start)
        blocked, fused = results["census"], results["fused census"]
        worst = max(
            float(np.max(np.abs(blocked[c] - fused[c]) / np.maximum(1, np.abs(blocked[c]))))
            for c in fused.columns
            if c not in ("layer", "head", "slope")
        )
        flops = cfg.n_layers * cfg.n_heads * 2 * cfg.d_head * n_pos**2
        row = {name: statistics.median(t) for name, t in times.items()}
        row |= {"floor": flops / rate, "tokens": n_pos, "worst": worst}
        row["float64 heads"] = fused.attrs["float64_heads"]
        rows.append(row)
        print(row, flush=True)
    lines = [
        "# The census on its fused path (TransformerLens 3.x)",
        "",
        f"organism, one sequence (the README's text), one thread, median of {args.repeats} "
        f"(one run from 8,192 tokens), rotating order; float32 matrix products at "
        f"{rate / 1e9:.1f} GFLOP/s; load average {os.getloadavg()[0]:.2f} at the end. Made by "
        "`analyses/benchmarks/fused_census.py` (its docstring: each method, and what this does "
        "not measure).",
        "",
        "| tokens | flash forward | census (default) | fused census (no reach) | attention "
        "FLOP floor | census / flash | fused / flash | fused / floor | largest relative "
        "difference, fused vs blocked | heads in float64 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = r["flash forward"]
        lines.append(
            f"| {r['tokens']} | {base:.2f} s | {r['census']:.2f} s | {r['fused census']:.2f} s | "
            f"{r['floor']:.3f} s | {r['census'] / base:.2f}x | {r['fused census'] / base:.2f}x "
            f"| {r['fused census'] / r['floor']:.0f}x | {r['worst']:.1e} | {r['float64 heads']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        atomic_write_text(OUT, text)


if __name__ == "__main__":
    main()
