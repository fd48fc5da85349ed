"""Benchmark: one layer's attention statistics, fused (backend.fused) against the eager pattern.

On one layer's queries, keys and values of the bundled organism's shape (16 heads, head width
16, float32; random N(0, 1) entries, seed 0; the organism's ALiBi slopes, -m (t - j)), one
sequence, one thread, at each ``--lengths``. Methods, timed in rotating order, median of
``--repeats``:

* ``eager``          the eager attention in blocks of 256 query rows against their causal keys
                     (scores, bias, softmax, weights x values), the census forward's attention;
* ``flash``          the CPU flash kernel alone (``_scaled_dot_product_flash_attention_for_cpu``,
                     the bias as a float mask, in blocks of 64 rows): a fused forward's attention;
* ``fused32``        :func:`headsurgeon.backend.fused.attention_stats`, float32 only
                     (``tolerance=inf``: no head refined);
* ``fused``          the same with its default ``tolerance=1e-6`` (heads whose entropy bound
                     exceeds it computed again in float64: on these inputs, every head);
* ``fused64``        the same on float64 inputs (everything in float64 once);
* ``fused32+reach``  ``fused32`` plus the census's reach histogram, which needs every weight:
                     its ``weights`` callback (``exp(s - lse)`` of each block, from the scores
                     the row maxima are taken from) into ``probes._mass_by_distance``;
* ``flash+weights``  a sketch of the other design: the flash kernel at the forward's width (z and
                     lse only), then per block the scores, their maxima, ``A = exp(s - lse)``,
                     the entropy as ``Σ A (lse - s)`` (no log), ``Σ A (t - j)`` and the reach
                     histogram from ``A`` (float32 sums, as the blocked census);
* ``eager+census``   ``eager`` plus the census's reductions of each block
                     (:func:`headsurgeon.probes.pattern_sums` and the reach histogram).

The ratios are to ``eager`` and to ``flash`` of the same run. What it does not measure: the
rest of a forward (projections, MLP), the census's z-based columns (the same on both paths),
memory, other shapes; timings on a shared, loaded machine vary by tens of percent.

    OMP_NUM_THREADS=1 python analyses/benchmarks/fused_attention.py            # 512 2048 4096
    python analyses/benchmarks/fused_attention.py --lengths 512 --repeats 1 --no-write
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from headsurgeon import alibi
from headsurgeon.backend.fused import attention_stats
from headsurgeon.probes import _mass_by_distance, pattern_sums

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "benchmarks" / "fused_attention.md"
METHODS = (
    "eager",
    "flash",
    "fused32",
    "fused",
    "fused64",
    "fused32+reach",
    "flash+weights",
    "eager+census",
)
EAGER_ROWS, FLASH_ROWS = 256, 64


def eager(q, k, v, slopes, scale, reduce=False):
    """The eager attention in blocks of query rows; ``reduce``: the census's reductions too."""
    n_pos = q.shape[2]
    for start in range(0, n_pos, EAGER_ROWS):
        stop = min(start + EAGER_ROWS, n_pos)
        bias = alibi.bias_from_distance("standard", slopes, alibi.distance_rows(stop - start, stop))
        causal = alibi.causal_rows(stop - start, stop)
        scores = (q[:, :, start:stop] @ k[:, :, :stop].transpose(-1, -2)) * scale + bias
        pattern = scores.masked_fill(~causal, -math.inf).softmax(-1)
        pattern @ v[:, :, :stop]
        if reduce:
            pattern_sums(pattern, 1)
            _mass_by_distance(pattern, 1)


def flash(q, k, v, slopes, scale, weights=False):
    """The CPU flash kernel in blocks of query rows, the bias as a float mask; ``weights``: the
    census's statistics from the block's weights ``exp(s - lse)`` (flash+weights)."""
    n_pos = q.shape[2]
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bias = toeplitz(slopes, n_pos, FLASH_ROWS)
    positions = torch.arange(n_pos, dtype=torch.float32)
    for start in range(0, n_pos, FLASH_ROWS):
        stop = min(start + FLASH_ROWS, n_pos)
        mask = bias[None, :, : stop - start, n_pos - start : n_pos - start + stop]
        _, lse = kernel(
            q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], attn_mask=mask, scale=scale
        )
        if weights:
            scores = torch.baddbmm(
                mask[0], q[0, :, start:stop], k[0, :, :stop].transpose(1, 2), alpha=scale
            )[None]
            scores.amax(-1)
            gap = lse[..., None] - scores  # lse - s: -ln A
            entries = gap.neg().exp_()
            (entries * gap.nan_to_num_(posinf=0)).sum(-1)  # the entropy, no log
            entries @ (start - positions[:stop])  # Σ A (b - j)
            _mass_by_distance(entries, 1)


def toeplitz(slopes, n_pos, rows):
    """The causal ALiBi bias of every block of ``rows`` query rows, as views of one matrix."""
    i = torch.arange(rows)[:, None]
    distance = (i - (torch.arange(n_pos + rows)[None, :] - n_pos)).float()
    return (-slopes[:, None, None] * distance).masked_fill(distance < 0, -math.inf)


def with_reach(q, k, v, slopes):
    """fused32 with the census's reach histogram from its ``weights`` callback."""
    histogram = torch.zeros(q.shape[2], q.shape[1], dtype=torch.float64)

    def add(heads, start, weights):
        histogram[heads, : weights.shape[-1]] += _mass_by_distance(weights, 1)

    attention_stats(q, k, v, slopes, tolerance=math.inf, weights=add)


def runners(n_pos: int, n_heads: int, d_head: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n_pos, n_heads, d_head, generator=generator) for _ in range(3))
    slopes = alibi.slopes(n_heads)
    scale = 1 / math.sqrt(d_head)
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    wide = [t.double() for t in (q, k, v)]
    return {
        "eager": lambda: eager(qh, kh, vh, slopes, scale),
        "flash": lambda: flash(qh, kh, vh, slopes, scale),
        "fused32": lambda: attention_stats(q, k, v, slopes, tolerance=math.inf),
        "fused": lambda: attention_stats(q, k, v, slopes),
        "fused64": lambda: attention_stats(*wide, slopes),
        "fused32+reach": lambda: with_reach(q, k, v, slopes),
        "flash+weights": lambda: flash(qh, kh, vh, slopes, scale, weights=True),
        "eager+census": lambda: eager(qh, kh, vh, slopes, scale, reduce=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--d-head", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with torch.no_grad():
        for n_pos in args.lengths:
            run = runners(n_pos, args.heads, args.d_head)
            for name in METHODS:  # warm-up: first-call allocations
                run[name]()
            times = {name: [] for name in METHODS}
            for repeat in range(args.repeats):
                order = METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)]
                for name in order:
                    start = time.perf_counter()
                    run[name]()
                    times[name].append(time.perf_counter() - start)
            results[n_pos] = {name: statistics.median(t) for name, t in times.items()}
            print(n_pos, {name: round(t, 4) for name, t in results[n_pos].items()}, flush=True)
    lines = [
        "# Fused attention statistics against the eager pattern (one layer)",
        "",
        f"{args.heads} heads, head width {args.d_head}, float32, one sequence, one thread, "
        f"random q/k/v (seed 0), the ALiBi slopes of {args.heads} heads; median of "
        f"{args.repeats}, rotating order; load average {os.getloadavg()[0]:.2f} at the end. "
        "Seconds, and ratios to eager and to flash of the same run. Made by "
        "`analyses/benchmarks/fused_attention.py` (its docstring says what each method is and "
        "what the table does not measure).",
        "",
        "| tokens | " + " | ".join(METHODS) + " |",
        "|---:|" + "---:|" * len(METHODS),
    ]
    for n_pos, row in results.items():
        lines.append(f"| {n_pos} | " + " | ".join(f"{row[m]:.3f} s" for m in METHODS) + " |")
        for base in ("eager", "flash"):
            ratios = " | ".join(f"{row[m] / row[base]:.2f}x" for m in METHODS)
            lines.append(f"| / {base} | {ratios} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        for path, content in (
            (OUT, text),
            (OUT.with_suffix(".json"), json.dumps({"args": vars(args), "seconds": results}) + "\n"),
        ):
            partial = path.with_name(path.name + ".partial")
            partial.write_text(content)
            partial.replace(path)  # atomic: never half a table


if __name__ == "__main__":
    main()
