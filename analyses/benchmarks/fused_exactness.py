"""Exactness of the fused attention statistics on the bundled organism's own queries and keys.

One sequence of ``--length`` tokens (the README's text, cut by ``hs.to_sequences``) through
``organism``; each layer's ``hook_q``/``hook_k``/``hook_v``. Per head, the census's seven pattern
statistics (rows from 1) by three ways, each against the same statistics of a float64 softmax of
the same q/k/v: ``fused32`` (:func:`headsurgeon.backend.fused.attention_stats` with
``tolerance=inf``: float32 only), ``fused`` (its default ``tolerance=1e-6``: heads refined in
float64) and ``blocked32`` (the float32 pattern reduced by :func:`headsurgeon.probes.pattern_sums`,
the census's path). Reported: the largest absolute difference over layers and heads, and the
time of the two fused calls. One sequence, one model, one text: it shows the size of the
rounding, not its distribution.

    OMP_NUM_THREADS=1 python analyses/benchmarks/fused_exactness.py --length 2048
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from headsurgeon import load_model
from headsurgeon.backend.fused import attention_stats, census_row_sums
from headsurgeon.data import to_sequences
from headsurgeon.loading import model_info
from headsurgeon.outputs import atomic_write_text
from headsurgeon.probes import PATTERN_STATS, pattern_sums

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "benchmarks" / "fused_exactness.md"
ROWS = 256


def means(sums_and_rows) -> torch.Tensor:
    sums, rows = sums_and_rows
    return sums.double() / torch.tensor(rows, dtype=torch.float64).clamp(min=1)[:, None, None]


def eager_means(q, k, slopes, dtype) -> torch.Tensor:
    """The pattern statistics of the softmax in ``dtype``, in blocks of query rows."""
    qh, kh = (t.transpose(1, 2).to(dtype) for t in (q, k))
    n_pos, scale = q.shape[1], 1 / math.sqrt(q.shape[-1])
    parts = []
    for start in range(0, n_pos, ROWS):
        stop = min(start + ROWS, n_pos)
        distance = torch.arange(start, stop)[:, None] - torch.arange(stop)[None, :]
        scores = qh[:, :, start:stop] @ kh[:, :, :stop].transpose(-1, -2) * scale
        scores = scores - slopes.to(dtype)[:, None, None] * distance.to(dtype)
        parts.append(pattern_sums(scores.masked_fill(distance < 0, -math.inf).softmax(-1), 1))
    sums = sum(part[0].double() for part in parts)
    rows = [sum(part[1][i] for part in parts) for i in range(len(PATTERN_STATS))]
    return means((sums, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model("organism")
    info = model_info(model)
    text = (ROOT / "README.md").read_text() * 4
    tokens = to_sequences(model, text, seq_len=args.length, n_seqs=1).tokens
    seen = {}

    def keep(name):
        return lambda tensor, hook: seen.__setitem__(name, tensor.detach().clone())

    names = [f"blocks.{i}.attn.hook_{n}" for i in range(model.cfg.n_layers) for n in "qkv"]
    with torch.no_grad():
        model.run_with_hooks(
            tokens, fwd_hooks=[(n, keep(n)) for n in names], stop_at_layer=model.cfg.n_layers
        )
    worst = {name: [0.0, 0.0, 0.0] for name in PATTERN_STATS}
    seconds, refined = [0.0, 0.0], 0
    for layer in range(model.cfg.n_layers):
        q, k, v = (seen[f"blocks.{layer}.attn.hook_{n}"] for n in "qkv")
        exact = eager_means(q, k, info.slopes, torch.float64)
        blocked = eager_means(q, k, info.slopes, torch.float32)
        start = time.perf_counter()
        plain = means(census_row_sums(attention_stats(q, k, v, info.slopes, tolerance=math.inf)))
        middle = time.perf_counter()
        stats = attention_stats(q, k, v, info.slopes)
        seconds[0] += middle - start
        seconds[1] += time.perf_counter() - middle
        refined += int(stats.refined.sum())
        for i, name in enumerate(PATTERN_STATS):
            for j, way in enumerate((plain, means(census_row_sums(stats)), blocked)):
                worst[name][j] = max(worst[name][j], (way[i] - exact[i]).abs().max().item())
    lines = [
        f"# Fused attention statistics: exactness on organism, {args.length} tokens",
        "",
        "Largest |x - float64| over the 4 layers x 16 heads of one sequence (the README's "
        "text), per-head means over query rows 1... Made by "
        "`analyses/benchmarks/fused_exactness.py` (its docstring: what each column is, what "
        "this does not show).",
        "",
        "| statistic | fused32 | fused (1e-6) | blocked32 |",
        "|---|---:|---:|---:|",
        *(f"| {n} | {a:.1e} | {b:.1e} | {c:.1e} |" for n, (a, b, c) in worst.items()),
        "",
        f"Heads refined in float64 at 1e-6: {refined} of {4 * model.cfg.n_heads}. Time of the "
        f"fused calls over the 4 layers, one thread: fused32 {seconds[0]:.2f} s, fused "
        f"{seconds[1]:.2f} s.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        atomic_write_text(OUT, text)


if __name__ == "__main__":
    main()
