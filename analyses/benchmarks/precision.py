"""Benchmark: the precision counterfactual against two plain and two fused forward passes.

On one sequence of T held-out Shakespeare tokens of the bundled ``organism`` (4 layers x 16
heads x 256), in one process, one thread by default:

* ``plain``: two forward passes of the model's transformers copy (float64 and bfloat16, the
  least a comparison of one dtype with a reference needs), in blocks of query rows through a
  key-value cache (:func:`headsurgeon.long_context.block_size`'s rows for a plain forward),
  logits included: transformers' eager BLOOM attention;
* ``fused``: the same two passes, same blocks, with each attention module's scores, softmax and
  weighted values replaced by ``torch.nn.functional.scaled_dot_product_attention`` (the ALiBi
  bias plus the causal mask as one float mask, as transformers' SDPA paths of ALiBi models
  hand it). transformers' BLOOM refuses ``attn_implementation="sdpa"`` ("does not support an
  attention implementation through torch.nn.functional.scaled_dot_product_attention yet",
  transformers 5.25), so this is the closest fused pass of the same model; the script prints
  its largest logit difference from ``plain`` (a check, not a timing). The issue's denominator;
* ``counterfactual``: :func:`headsurgeon.precision.precision_effect` with its defaults (three
  dtypes x three parts: nine passes and the float64 reference, plus the per-head table of
  every recipe in every layer), its own default blocks;
* ``no heads``: the same with ``head_table=False`` (what the per-head table costs).

The goal (issue 54) is a counterfactual within 3x the two fused passes. Each length runs
``--repeats`` times (median reported), after a warm-up on 128 tokens; the peak resident set of
the process is printed after each length (``ru_maxrss``: the largest so far). Written: the
markdown table ``--out`` (command, machine, date, load average, rows).

    OMP_NUM_THREADS=1 python analyses/benchmarks/precision.py --lengths 1024 4096
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import headsurgeon as hs
from headsurgeon import long_context
from headsurgeon.backend.cache import hf_kv_cache
from headsurgeon.checkpoints import hf_model
from headsurgeon.precision import precision_effect


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _sdpa_forward(module, hidden_states, residual, alibi, attention_mask, layer_past=None, **_):
    """BloomAttention.forward with its attention as one fused kernel call."""
    from transformers.models.bloom.modeling_bloom import dropout_add

    batch, n_queries, _ = hidden_states.shape
    q, k, v = module._reshape(module.query_key_value(hidden_states))
    if layer_past is not None:
        k, v = layer_past.update(k, v, module.layer_idx)
    mask = alibi.view(batch, module.num_heads, 1, -1)  # beta = 1: scores = alibi + q.k / sqrt(d)
    if attention_mask is not None:
        mask = mask + attention_mask
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=module.inv_norm_factor)
    out = module.dense(z.transpose(1, 2).reshape(batch, n_queries, -1))
    return dropout_add(out, residual, module.hidden_dropout, module.training), None


@contextlib.contextmanager
def fused_attention(models: list[torch.nn.Module]):
    """Every BloomAttention of ``models`` computes through SDPA for the ``with`` block."""
    modules = [m for hf in models for m in hf.modules() if type(m).__name__ == "BloomAttention"]
    for module in modules:
        module.forward = _sdpa_forward.__get__(module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


@torch.no_grad()
def plain(models: list[torch.nn.Module], tokens: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Each model's forward over ``tokens`` in blocks through its own key-value cache; the
    logits of the first model's last block and of the second's."""
    last = []
    for hf in models:
        cache = hf_kv_cache()
        for offset in range(0, tokens.shape[1], block):
            logits = hf(tokens[:, offset : offset + block], cache=cache, use_cache=True).logits
        last.append(logits.double())
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-heads", action="store_true", help="also time head_table=False")
    parser.add_argument("--out", default="figures/benchmarks/precision_run.md")
    parser.add_argument(
        "--peak-rss", type=int, metavar="BLOCK", help="only: the process's peak resident set "
        "after one counterfactual of the first length in blocks of BLOCK rows, and its entries"
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = hs.load_model("organism", device=args.device)
    if args.peak_rss:
        _peak_rss(model, args.lengths[0], args.peak_rss)
        return
    models = [hf_model(model, dtype).to(device) for dtype in (torch.float64, torch.bfloat16)]
    rows = []
    load = os.getloadavg()[0]
    for length in args.lengths:
        tokens = hs.to_sequences(model, seq_len=length, n_seqs=1).tokens.to(device)
        block = long_context.block_size(model, length)
        warm = tokens[:, :128]
        plain(models, warm, block)
        with fused_attention(models):
            plain(models, warm, block)
        precision_effect(model, warm, progress=False)
        times = {"plain": [], "fused": [], "counterfactual": [], "no_heads": []}
        for _ in range(args.repeats):
            _sync(device)
            start = time.perf_counter()
            eager = plain(models, tokens, block)
            _sync(device)
            times["plain"].append(time.perf_counter() - start)
            with fused_attention(models):
                start = time.perf_counter()
                fused = plain(models, tokens, block)
                _sync(device)
                times["fused"].append(time.perf_counter() - start)
            start = time.perf_counter()
            effect = precision_effect(model, tokens, progress=False)
            _sync(device)
            times["counterfactual"].append(time.perf_counter() - start)
            if args.no_heads:
                start = time.perf_counter()
                precision_effect(model, tokens, progress=False, head_table=False)
                _sync(device)
                times["no_heads"].append(time.perf_counter() - start)
        median = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
        late = effect.by_position[effect.by_position.position_lo >= 1024]
        bf16 = late[(late.dtype == "bfloat16") & (late.part == "model")]
        rows.append(
            {
                "T": length,
                "block": effect.by_position.attrs["block_size"],
                "plain_s": median["plain"],
                "fused_s": median["fused"],
                "counterfactual_s": median["counterfactual"],
                "no_heads_s": median["no_heads"],
                "fused_vs_plain_f64": (fused[0] - eager[0]).abs().max().item(),
                "fused_vs_plain_bf16": (fused[1] - eager[1]).abs().max().item(),
                "bf16_dnll_1024+": (bf16.mean_dnll * bf16.tokens).sum() / bf16.tokens.sum()
                if len(bf16)
                else float("nan"),
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
        )
        print(rows[-1], flush=True)
        _write(Path(args.out), args, rows, load)


def _peak_rss(model: torch.nn.Module, length: int, block: int) -> None:
    """Print the peak resident set of one counterfactual in blocks of ``block`` rows and the
    entries of its largest block: two such runs give the bytes an entry holds."""
    tokens = hs.to_sequences(model, seq_len=length, n_seqs=1).tokens
    precision_effect(model, tokens, progress=False, block_size=block)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    entries = model.cfg.n_heads * min(block, length) * length
    print(f"T {length}, block {block}: peak RSS {peak / 2**20:.0f} MiB, {entries:,} entries")


def _write(out: Path, args: argparse.Namespace, rows: list[dict], load: float) -> None:
    device = args.device
    if device.startswith("cuda"):
        device += f" ({torch.cuda.get_device_name()})"
    lines = [
        "# Precision counterfactual: time against two plain and two fused forward passes",
        "",
        f"Command: `python {' '.join(sys.argv)}`  ",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"{args.threads} torch thread(s), device {device}; torch {torch.__version__}; load "
        f"average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
        "",
        "| T | block | plain (s) | fused (s) | counterfactual (s) | / plain | / fused |"
        " no heads (s) | bf16 ΔNLL at ≥ 1,024 | peak RSS (GiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']:,} | {r['block']} | {r['plain_s']:.1f} | {r['fused_s']:.1f} | "
            f"{r['counterfactual_s']:.1f} | {r['counterfactual_s'] / r['plain_s']:.1f}x | "
            f"{r['counterfactual_s'] / r['fused_s']:.1f}x | {r['no_heads_s']:.1f} | "
            f"{r['bf16_dnll_1024+']:+.3f} | {r['peak_rss_gib']:.2f} |"
        )
        lines[-1] = lines[-1].replace("+nan", "-").replace("nan", "-")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
