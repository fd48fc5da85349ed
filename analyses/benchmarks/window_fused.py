"""Benchmark (TransformerLens 3.x): the window counterfactual on the fused attention against its
blocked path and the fused forward (issue 54, item 3).

On ``organism`` (4 layers, 16 heads, head width 16, float32), one sequence of each ``--lengths``
tokens (the README's text), one thread, median of ``--repeats``, rotating order:

* ``flash forward``  one forward with each attention the CPU flash kernel on ``hook_q/k/v``
                     (``fused_census_forward.flash_z``): what one pass costs at best;
* ``blocked``        ``window_effect`` with its default distances (1, 2, 4 ... below the length)
                     and 4 heads cut alone at distance 64, on the blocked path (the scores hooks;
                     taken because a no-op hook sits on ``blocks.0.attn.hook_pattern``);
* ``fused``          the same call on the fused path (its default for this model).

Both make ``2 + distances + 4`` passes; the table gives each per pass against one flash forward,
and the largest difference of the fused ΔNLL (by distance and by head) from the blocked one (a
check, not a timing). Not measured: memory, TransformerLens 4.x, batches of several sequences.

    OMP_NUM_THREADS=1 python analyses/benchmarks/window_fused.py --lengths 1024 2048 4096
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

from headsurgeon import load_model, window_effect
from headsurgeon.backend import wraps_hf_model
from headsurgeon.data import to_sequences
from headsurgeon.loading import model_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_census_forward import attention_by, flash_z  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "benchmarks" / "window_fused.md"
METHODS = ("flash forward", "blocked", "fused")
KWARGS = dict(heads="L0H0,L1H5,L2H10,L3H15", head_distance=64, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model("organism")
    if wraps_hf_model(model):
        raise SystemExit("window_fused.py measures TransformerLens 3.x's fused path")
    slopes = model_info(model).slopes
    text = (ROOT / "README.md").read_text() * 40
    noop = [("blocks.0.attn.hook_pattern", lambda pattern, hook: None)]
    rows = []
    for n_pos in args.lengths:
        tokens = to_sequences(model, text, seq_len=n_pos, n_seqs=1).tokens

        def flash(t=tokens):
            with torch.no_grad(), attention_by(model, slopes, flash_z):
                model(t, stop_at_layer=model.cfg.n_layers)

        def blocked(t=tokens):
            with model.hooks(fwd_hooks=noop):
                return window_effect(model, t, **KWARGS)

        run = {
            "flash forward": flash,
            "blocked": blocked,
            "fused": lambda t=tokens: window_effect(model, t, **KWARGS),
        }
        times = {name: [] for name in METHODS}
        results = {}
        for repeat in range(args.repeats):
            for name in METHODS[repeat % 3 :] + METHODS[: repeat % 3]:
                start = time.perf_counter()
                results[name] = run[name]()
                times[name].append(time.perf_counter() - start)
        slow, fast = results["blocked"], results["fused"]
        assert slow.by_distance.attrs["attention"] == "blocked"
        assert fast.by_distance.attrs["attention"] == "fused"
        worst = max(
            float(np.max(np.abs(a["dnll"].to_numpy() - b["dnll"].to_numpy())))
            for a, b in ((slow.by_distance, fast.by_distance), (slow.by_head, fast.by_head))
        )
        passes = 2 + fast.by_distance["distance"].nunique() + len(fast.by_head)
        row = {name: statistics.median(t) for name, t in times.items()}
        row |= {"tokens": n_pos, "passes": passes, "worst": worst}
        rows.append(row)
        print(row, flush=True)
    lines = [
        "# The window counterfactual on the fused attention (TransformerLens 3.x)",
        "",
        f"organism, one sequence (the README's text), one thread, median of {args.repeats}, "
        f"rotating order; load average {os.getloadavg()[0]:.2f} at the end. Made by "
        "`analyses/benchmarks/window_fused.py` (its docstring: each method, and what this does "
        "not measure).",
        "",
        "| tokens | passes | flash forward | blocked | fused | blocked / fused | blocked per "
        "pass / flash | fused per pass / flash | largest ΔNLL difference, fused vs blocked |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base, n = r["flash forward"], r["passes"]
        lines.append(
            f"| {r['tokens']} | {n} | {base:.2f} s | {r['blocked']:.2f} s | {r['fused']:.2f} s "
            f"| {r['blocked'] / r['fused']:.2f}x | {r['blocked'] / n / base:.2f}x "
            f"| {r['fused'] / n / base:.2f}x | {r['worst']:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        partial = OUT.with_name(OUT.name + ".partial")
        partial.write_text(text)
        partial.replace(OUT)


if __name__ == "__main__":
    main()
