"""Benchmark: the precision counterfactual against two plain forward passes, same run.

On one sequence of T held-out Shakespeare tokens of the bundled ``organism`` (4 layers x 16
heads x 256), in one process:

* ``plain``: two forward passes of the model's transformers copy (float64 and bfloat16, the
  least a comparison of one dtype with a reference needs), in the same blocks of query rows
  through a key-value cache as the counterfactual, logits included;
* ``counterfactual``: :func:`headsurgeon.precision.precision_effect` with its defaults (three
  dtypes x three parts: nine passes and the float64 reference, plus the per-head comparison of
  every recipe in every layer).

``no heads``: the counterfactual with the per-head table switched off (its ``HeadTable`` made
a no-op), to show what the table costs. The goal is a counterfactual within 3x the two plain
passes. Each length runs ``--repeats``
times (the median is reported), after a warm-up on 128 tokens. Written: the markdown report
``--out`` (command, machine, date, rows). ``--device cuda`` runs both on a GPU.

    python analyses/benchmarks/precision.py --lengths 4096
    python analyses/benchmarks/precision.py --lengths 4096 16384 --device cuda \\
        --out figures/benchmarks/precision_gpu.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import headsurgeon as hs
from headsurgeon import long_context, precision
from headsurgeon.backend.cache import hf_kv_cache
from headsurgeon.checkpoints import hf_model
from headsurgeon.precision import PRECISION_BYTES_PER_ENTRY, precision_effect


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def plain(models: list[torch.nn.Module], tokens: torch.Tensor, block: int) -> None:
    """Each model's forward over ``tokens`` in blocks through its own key-value cache."""
    for hf in models:
        cache = hf_kv_cache()
        for offset in range(0, tokens.shape[1], block):
            hf(tokens[:, offset : offset + block], cache=cache, use_cache=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="figures/benchmarks/precision.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = hs.load_model("organism", device=args.device)
    models = [hf_model(model, dtype).to(device) for dtype in (torch.float64, torch.bfloat16)]
    rows = []
    for length in args.lengths:
        tokens = hs.to_sequences(model, seq_len=length, n_seqs=1).tokens.to(device)
        block = long_context.block_size(model, length, bytes_per_entry=PRECISION_BYTES_PER_ENTRY)
        warm = tokens[:, :128]
        plain(models, warm, block)
        precision_effect(model, warm, progress=False)
        times = {"plain": [], "counterfactual": [], "no_heads": []}
        for _ in range(args.repeats):
            _sync(device)
            start = time.perf_counter()
            plain(models, tokens, block)
            _sync(device)
            times["plain"].append(time.perf_counter() - start)
            start = time.perf_counter()
            effect = precision_effect(model, tokens, progress=False)
            _sync(device)
            times["counterfactual"].append(time.perf_counter() - start)
            table_call = precision.HeadTable.__call__
            precision.HeadTable.__call__ = lambda *args: None
            try:
                start = time.perf_counter()
                precision_effect(model, tokens, progress=False)
                _sync(device)
                times["no_heads"].append(time.perf_counter() - start)
            finally:
                precision.HeadTable.__call__ = table_call
        median = {k: statistics.median(v) for k, v in times.items()}
        late = effect.by_position[effect.by_position.position_lo >= 1024]
        bf16 = late[(late.dtype == "bfloat16") & (late.part == "model")]
        rows.append(
            {
                "T": length,
                "block": block,
                "plain_s": median["plain"],
                "counterfactual_s": median["counterfactual"],
                "ratio": median["counterfactual"] / median["plain"],
                "no_heads_s": median["no_heads"],
                "bf16_dnll_1024+": (bf16.mean_dnll * bf16.tokens).sum() / max(bf16.tokens.sum(), 1),
            }
        )
        print(rows[-1], flush=True)
        _write(Path(args.out), args, rows)


def _write(out: Path, args: argparse.Namespace, rows: list[dict]) -> None:
    device = args.device
    if device.startswith("cuda"):
        device += f" ({torch.cuda.get_device_name()})"
    lines = [
        "# Precision counterfactual: time against two plain forward passes",
        "",
        f"Command: `python {' '.join(sys.argv)}`  ",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"{args.threads} torch thread(s), device {device}; torch {torch.__version__}",
        "",
        "`plain`: the organism's transformers copy in float64 and in bfloat16, one pass each, in "
        "the same blocks through a key-value cache. `counterfactual`: "
        "`precision_effect(model)` (3 dtypes x 3 parts + the float64 reference, per-head "
        "table included); `no heads`: the same without the per-head table. Median of the "
        "repeats, seconds. The machine was shared (other jobs running): compare within a row.",
        "",
        "| T | block | plain (s) | counterfactual (s) | ratio | no heads (s) | ratio |"
        " bf16 ΔNLL at ≥ 1,024 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']:,} | {r['block']} | {r['plain_s']:.1f} | {r['counterfactual_s']:.1f} | "
            f"{r['ratio']:.1f}x | {r['no_heads_s']:.1f} | {r['no_heads_s'] / r['plain_s']:.1f}x | "
            f"{r['bf16_dnll_1024+']:+.3f} |"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
