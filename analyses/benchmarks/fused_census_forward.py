"""Benchmark (TransformerLens 3.x): the whole organism forward with its attention fused.

What a fused census would cost next to the issue's baseline, before run_census is wired (issue
54). On ``organism`` (4 layers, 16 heads, head width 16, float32), one sequence of each
``--lengths`` tokens (the README's text), one thread, median of ``--repeats`` in rotating order:

* ``forward``        TransformerLens's own forward, stopped before the unembedding (its eager
                     attention: the whole T x T pattern per layer);
* ``flash forward``  the same forward with each attention replaced by the CPU flash kernel on
                     ``hook_q/k/v`` (z only; ALiBi as a float mask, blocks of 64 query rows):
                     the issue's denominator, a forward whose attention is the fused kernel;
* ``fused32``        each attention replaced by
                     :func:`headsurgeon.backend.fused.attention_stats` with ``tolerance=inf``
                     (float32; every census statistic but reach, and z);
* ``fused``          the same at its default ``tolerance=1e-6`` (float64 where the bound says);
* ``census``         ``run_census`` as it is (blocked path, every default column, reach too).

Each replacement computes ``hook_q/k/v`` with the layer's own code, fires ``hook_z`` and forms
the output as TransformerLens does (``F.linear(z, W_O, b_O)``); the script checks the residual
stream against ``forward`` (largest difference printed). Not measured: the census's hooks on the
fused path (z-based columns, the same work on both paths), reach on the fused path (see
``fused_attention.py``'s ``fused32+reach``), memory, TransformerLens 4.x.

    OMP_NUM_THREADS=1 python analyses/benchmarks/fused_census_forward.py --lengths 512 2048
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from pathlib import Path

import einops
import torch
import torch.nn.functional as F

from headsurgeon import load_model, run_census
from headsurgeon.backend import wraps_hf_model
from headsurgeon.backend.fused import attention_stats
from headsurgeon.data import to_sequences
from headsurgeon.loading import model_info
from headsurgeon.outputs import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "benchmarks" / "fused_census_forward.md"
METHODS = ("forward", "flash forward", "fused32", "fused", "census")
ROWS = 64


def flash_z(q, k, v, slopes):
    """z of causal ALiBi attention from the CPU flash kernel, in blocks of query rows."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    n_pos, scale = q.shape[1], 1 / math.sqrt(q.shape[-1])
    i = torch.arange(ROWS)[:, None]
    distance = (i - (torch.arange(n_pos + ROWS)[None, :] - n_pos)).float()
    bias = (-slopes[:, None, None] * distance).masked_fill(distance < 0, -math.inf)
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    z = torch.empty_like(qh)
    for start in range(0, n_pos, ROWS):
        stop = min(start + ROWS, n_pos)
        mask = bias[None, :, : stop - start, n_pos - start : n_pos - start + stop]
        z[:, :, start:stop] = kernel(
            qh[:, :, start:stop], kh[:, :, :stop], vh[:, :, :stop], attn_mask=mask, scale=scale
        )[0]
    return z.transpose(1, 2)


@contextlib.contextmanager
def attention_by(model, slopes, z_of):
    """Every attention layer computes ``z = z_of(q, k, v, slopes)`` for the ``with`` block."""

    def forward(attn, query_input, key_input, value_input, *args, **kwargs):
        q, k, v = attn.calculate_qkv_matrices(query_input, key_input, value_input)
        z = attn.hook_z(z_of(q, k, v, slopes))
        w = einops.rearrange(attn.W_O, "head d_head d_model -> d_model (head d_head)")
        return F.linear(z.reshape(*z.shape[:2], -1), w.contiguous(), attn.b_O)

    for block in model.blocks:
        block.attn.forward = forward.__get__(block.attn)
    try:
        yield
    finally:
        for block in model.blocks:
            del block.attn.forward


def load_organism(script: str):
    """The organism on TransformerLens 3.x (these scripts replace its attention's forward) and
    its slopes; one line and exit elsewhere."""
    model = load_model("organism")
    if wraps_hf_model(model):
        raise SystemExit(f"{script} replaces TransformerLens 3.x's attention forward")
    return model, model_info(model).slopes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, slopes = load_organism("fused_census_forward.py")
    n_layers = model.cfg.n_layers
    text = (ROOT / "README.md").read_text() * 4

    def stats_z(tolerance):
        return lambda q, k, v, m: attention_stats(q, k, v, m, tolerance=tolerance).z

    def fused_run(z_of, tokens):
        with attention_by(model, slopes, z_of):
            return model(tokens, stop_at_layer=n_layers)

    results, checks = {}, {}
    for n_pos in args.lengths:
        tokens = to_sequences(model, text, seq_len=n_pos, n_seqs=1).tokens
        run = {
            "forward": lambda t=tokens: model(t, stop_at_layer=n_layers),
            "flash forward": lambda t=tokens: fused_run(flash_z, t),
            "fused32": lambda t=tokens: fused_run(stats_z(math.inf), t),
            "fused": lambda t=tokens: fused_run(stats_z(1e-6), t),
            "census": lambda t=tokens: run_census(model, t, progress=False),
        }
        with torch.no_grad():
            reference = run["forward"]()
            checks[n_pos] = {
                name: (run[name]() - reference).abs().max().item()
                for name in ("flash forward", "fused32", "fused")
            }
            times = {name: [] for name in METHODS}
            for repeat in range(args.repeats):
                order = METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)]
                for name in order:
                    start = time.perf_counter()
                    run[name]()
                    times[name].append(time.perf_counter() - start)
        results[n_pos] = {name: statistics.median(t) for name, t in times.items()}
        print(n_pos, results[n_pos], checks[n_pos], flush=True)
    lines = [
        "# The organism's forward with its attention fused (TransformerLens 3.x)",
        "",
        f"organism, one sequence (the README's text), one thread, median of {args.repeats}, "
        f"rotating order; load average {os.getloadavg()[0]:.2f} at the end. Seconds, and "
        "ratios to `flash forward` (the issue's denominator). Made by "
        "`analyses/benchmarks/fused_census_forward.py` (its docstring: each method, and what "
        "this does not measure).",
        "",
        "| tokens | " + " | ".join(METHODS) + " | largest residual difference (flash, 32, 1e-6) |",
        "|---:|" + "---:|" * len(METHODS) + "---|",
    ]
    for n_pos, row in results.items():
        diffs = ", ".join(f"{d:.1e}" for d in checks[n_pos].values())
        lines.append(
            f"| {n_pos} | " + " | ".join(f"{row[m]:.2f} s" for m in METHODS) + f" | {diffs} |"
        )
        base = row["flash forward"]
        ratios = " | ".join(f"{row[m] / base:.2f}x" for m in METHODS)
        lines.append(f"| / flash forward | {ratios} | |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        atomic_write_text(OUT, text)


if __name__ == "__main__":
    main()
