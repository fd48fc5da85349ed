"""Benchmark (TransformerLens 3.x): the window and sink-cache counterfactuals on the fused
attention against their blocked path and the fused forward (issue 54, item 3).

On ``organism`` (4 layers, 16 heads, head width 16, float32), one sequence of each ``--lengths``
tokens (the README's text), one thread, median of ``--repeats``, rotating order:

* ``flash forward``  one forward with each attention the CPU flash kernel on ``hook_q/k/v``
                     (``fused_census_forward.flash_z``): what one pass costs at best;
* ``window``         ``window_effect`` with its default distances (1, 2, 4 ... below the length)
                     and 4 heads cut alone at distance 64;
* ``sink cache``     ``sink_cache_effect`` with sinks 0, 1, 4, its default windows (128 and 512
                     for the organism) and the same 4 heads tested alone;

each on the blocked path (a no-op hook on ``blocks.0.attn.hook_pattern``, which the fused
attention would not fire, sends it there) and on the fused one (its default for this model).
The table gives the passes each makes, the time per pass against one flash forward, and the
largest difference of the fused ΔNLL (every row of both tables) from the blocked one (a check,
not a timing). Not measured: memory, TransformerLens 4.x, batches of several sequences.

    OMP_NUM_THREADS=1 python analyses/benchmarks/fused_counterfactuals.py --lengths 1024 4096
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from headsurgeon import sink_cache_effect, window_effect
from headsurgeon.data import to_sequences
from headsurgeon.outputs import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_census_forward import attention_by, flash_z, load_organism  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "benchmarks" / "fused_counterfactuals.md"
HEADS = "L0H0,L1H5,L2H10,L3H15"
VERBS = {
    "window": (window_effect, dict(heads=HEADS, head_distance=64), ("by_distance", "by_head")),
    "sink cache": (sink_cache_effect, dict(sinks=[0, 1, 4], heads=HEADS), ("by_cache", "by_head")),
}
METHODS = ("flash forward", *(f"{verb} {path}" for verb in VERBS for path in ("blocked", "fused")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, slopes = load_organism("fused_counterfactuals.py")
    text = (ROOT / "README.md").read_text() * 40
    noop = [("blocks.0.attn.hook_pattern", lambda pattern, hook: None)]
    rows = []
    for n_pos in args.lengths:
        tokens = to_sequences(model, text, seq_len=n_pos, n_seqs=1).tokens

        def flash(t=tokens):
            with torch.no_grad(), attention_by(model, slopes, flash_z):
                model(t, stop_at_layer=model.cfg.n_layers)

        def verb(name, path, t=tokens):
            call, kwargs, _ = VERBS[name]
            with model.hooks(fwd_hooks=noop if path == "blocked" else []):
                return call(model, t, **kwargs, progress=False)

        run = {"flash forward": flash}
        run |= {
            f"{n} {p}": functools.partial(verb, n, p) for n in VERBS for p in ("blocked", "fused")
        }
        times = {name: [] for name in METHODS}
        results = {}
        for repeat in range(args.repeats):
            shift = repeat % len(METHODS)
            for name in METHODS[shift:] + METHODS[:shift]:
                start = time.perf_counter()
                results[name] = run[name]()
                times[name].append(time.perf_counter() - start)
        for name, (_, _, tables) in VERBS.items():
            slow, fast = results[f"{name} blocked"], results[f"{name} fused"]
            assert getattr(slow, tables[0]).attrs["attention"] == "blocked"
            assert getattr(fast, tables[0]).attrs["attention"] == "fused"
            worst = max(
                float(np.max(np.abs(getattr(slow, t)["dnll"] - getattr(fast, t)["dnll"])))
                for t in tables
            )
            first, heads = (len(getattr(fast, t)) for t in tables)
            if name == "window":  # the model's own pass, each distance, each head
                passes = 1 + getattr(fast, tables[0])["distance"].nunique() + heads
            else:  # the full context, each cache, the per-head base, each head
                passes = 1 + first + 1 + heads
            row = {
                "verb": name,
                "tokens": n_pos,
                "passes": passes,
                "flash": statistics.median(times["flash forward"]),
                "blocked": statistics.median(times[f"{name} blocked"]),
                "fused": statistics.median(times[f"{name} fused"]),
                "worst": worst,
            }
            rows.append(row)
            print(row, flush=True)
    lines = [
        "# The window and sink-cache counterfactuals on the fused attention (TransformerLens 3.x)",
        "",
        f"organism, one sequence (the README's text), one thread, median of {args.repeats}, "
        f"rotating order; load average {os.getloadavg()[0]:.2f} at the end. Made by "
        "`analyses/benchmarks/fused_counterfactuals.py` (its docstring: each method, and what "
        "this does not measure).",
        "",
        "| verb | tokens | passes | flash forward | blocked | fused | blocked / fused | "
        "blocked per pass / flash | fused per pass / flash | largest ΔNLL difference, fused vs "
        "blocked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base, n = r["flash"], r["passes"]
        lines.append(
            f"| {r['verb']} | {r['tokens']} | {n} | {base:.2f} s | {r['blocked']:.2f} s "
            f"| {r['fused']:.2f} s | {r['blocked'] / r['fused']:.2f}x "
            f"| {r['blocked'] / n / base:.2f}x | {r['fused'] / n / base:.2f}x "
            f"| {r['worst']:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        atomic_write_text(OUT, text)


if __name__ == "__main__":
    main()
