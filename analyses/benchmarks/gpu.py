"""Benchmark on one GPU: census, measured blindness, one repair step and the long-context census
of BLOOM-560m's and BLOOM-1b7's shapes (random weights, bfloat16), against ``transformers``.

One command, built to finish in under 8 minutes on one H100/H200-class GPU:

    python analyses/benchmarks/gpu.py                   # writes figures/benchmarks/gpu.md + .json
    python analyses/benchmarks/gpu.py --device cpu --shapes 2x4x64 --batch-size 2 --seq-len 64 \\
        --long 256 --fused-lengths 256 --out /tmp/gpu-smoke.md  # a smoke test of the script, CPU

Per shape, on ``--batch-size`` random sequences of ``--seq-len`` tokens (default 8 x 512), each
timed as the median of ``--repeats`` runs after one warm-up, with ``torch.cuda.synchronize``:

* ``hf-sdpa forward``       ``transformers``' model with ``attn_implementation="sdpa"``, no
                            patterns: the floor (where ``transformers`` has sdpa for BLOOM; else
                            the row says why not);
* ``hf-eager forward``      the same with eager attention;
* ``hf-eager + patterns``   eager with ``output_attentions=True`` and the census's pattern
                            reductions (:func:`headsurgeon.probes.pattern_stats`) on every layer:
                            the surgery paper's way, which has no per-head output;
* ``forward``               the installed TransformerLens model's plain forward;
* ``census``                :func:`headsurgeon.run_census` (every head's metrics);
* ``measured blindness``    :func:`headsurgeon.measure_blindness` in bfloat16 and float16;
* ``repair step``           one masked fine-tuning step (slices of the last head of every layer,
                            so the backward pass runs through every block; AdamW; bfloat16
                            autocast), by default and with ``gradient_checkpointing`` and
                            ``loss_chunk=512``;
* ``long census``           one sequence of ``--long`` tokens (default 16,384) through the
                            long-context path (:mod:`headsurgeon.long_context`), first shape only.
* ``fused census``          :func:`headsurgeon.run_census` with ``reach=False`` (issue 54); the
                            row names the path it took (``attrs["attention"]``: the fused path is
                            CPU-only today, so on a GPU it says ``blocked``);
* ``fused stats``           one layer of the shape, float32, one sequence of each
                            ``--fused-lengths`` (default 2,048 and 8,192):
                            :func:`headsurgeon.backend.fused.attention_stats` (FlexAttention on
                            CUDA, compiled, its row maxima; the CPU flash kernel elsewhere), the
                            row naming its largest relative difference from the same statistics
                            in float64 on CPU (the check of a kernel no test runs), at the
                            census's tolerance (heads above it are redone in float64); beside it
                            ``sdpa + ALiBi mask``: ``scaled_dot_product_attention`` with the
                            bias as a float mask, the fused forward it is measured against.

Memory is ``torch.cuda.max_memory_allocated`` above what was allocated before the row (the model
and its inputs), and absolute. Each row that fails (out of memory included) records its error
and the run goes on. The table is rewritten after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _shapes import parse_shape

import headsurgeon as hs
from headsurgeon.backend import MAJOR
from headsurgeon.backend.fused import attention_stats
from headsurgeon.census import FUSED_TOLERANCE
from headsurgeon.finetune import checkpointed_blocks, make_trainer, next_token_loss
from headsurgeon.loading import from_hf_model, random_hf_bloom
from headsurgeon.probes import pattern_stats
from headsurgeon.surgery import HeadSet

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


class Bench:
    """Rows of (shape, task) with time and memory, written as they come."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.rows = args, []
        self.device = torch.device(args.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.device.type == "cuda" else 0

    def row(self, shape: str, task: str, run: Callable[[], object], repeats: int | None = None):
        """Warm up, then time ``repeats`` runs of ``run``; memory over all of them."""
        repeats = repeats or self.args.repeats
        record = {"shape": shape, "task": task}
        try:
            self.sync()
            before = self.allocated()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            run()
            times = []
            for _ in range(repeats):
                self.sync()
                start = time.perf_counter()
                run()
                self.sync()
                times.append(time.perf_counter() - start)
            record |= {"time_s": statistics.median(times)}
            if self.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated()
                record |= {"extra_gib": (peak - before) / GIB, "peak_gib": peak / GIB}
        except Exception as error:  # noqa: BLE001 (a row's failure is a result)
            record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.rows.append(record)
        print(json.dumps(record), flush=True)
        self.write()

    def write(self) -> None:
        a = self.args
        name = torch.cuda.get_device_name() if self.device.type == "cuda" else "CPU"
        lines = [
            f"# GPU benchmark: {name}, bfloat16, batch {a.batch_size} x {a.seq_len} tokens",
            "",
            f"`python analyses/benchmarks/gpu.py {' '.join(sys.argv[1:])}`, TransformerLens "
            f"{MAJOR}.x, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}. Time: "
            f"median of {a.repeats} after a warm-up. Memory: max allocated above the model.",
            "",
            "| shape | task | time (ms) | / hf-eager + patterns | extra (GiB) | peak (GiB) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        base = {
            r["shape"]: r.get("time_s") for r in self.rows if r["task"] == "hf-eager + patterns"
        }
        for r in self.rows:
            if "error" in r:
                lines.append(f"| {r['shape']} | {r['task']} | {r['error']} | | | |")
                continue
            ratio = f"{r['time_s'] / base[r['shape']]:.2f}x" if base.get(r["shape"]) else ""
            extra = f"{r['extra_gib']:.2f}" if "extra_gib" in r else ""
            peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else ""
            lines.append(
                f"| {r['shape']} | {r['task']} | {r['time_s'] * 1e3:.1f} | {ratio} | "
                f"{extra} | {peak} |"
            )
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("\n".join(lines) + "\n")
        a.out.with_suffix(".json").write_text(
            json.dumps({"argv": sys.argv[1:], "device": name, "rows": self.rows}, indent=2)
        )


def hf_rows(bench: Bench, shape: str, hf, tokens: torch.Tensor) -> None:
    def forward(**kwargs):
        with torch.no_grad():
            return hf(tokens, **kwargs)

    def patterns():
        with torch.no_grad():
            for pattern in hf(tokens, output_attentions=True).attentions:
                pattern_stats(pattern, 1).double().sum(1)

    try:
        hf.set_attn_implementation("sdpa")
        bench.row(shape, "hf-sdpa forward", forward)
    except Exception as error:  # noqa: BLE001 (transformers may not offer sdpa for BLOOM)
        bench.rows.append({"shape": shape, "task": "hf-sdpa forward", "error": str(error)[:150]})
    hf.set_attn_implementation("eager")
    bench.row(shape, "hf-eager forward", forward)
    bench.row(shape, "hf-eager + patterns", patterns)


def tl_rows(bench: Bench, shape: str, model, tokens: torch.Tensor, long: int | None) -> None:
    n = len(tokens)

    def forward():
        with torch.no_grad():
            model(tokens)

    bench.row(shape, "forward", forward)
    bench.row(
        shape,
        "census",
        lambda: hs.run_census(model, tokens, batch_size=n, progress=False),
    )
    path = hs.run_census(model, tokens[:1], reach=False, progress=False).attrs["attention"]
    bench.row(
        shape,
        f"fused census (reach=False: {path})",
        lambda: hs.run_census(model, tokens, batch_size=n, reach=False, progress=False),
    )
    heads = HeadSet((layer, model.cfg.n_heads - 1) for layer in range(model.cfg.n_layers))
    for label, switches in (("default", {}), ("checkpointing + loss_chunk 512", {"chunk": 512})):
        model.requires_grad_(False)
        trainer = make_trainer(model, heads, functools.partial(next_token_loss, **switches))
        optimizer = torch.optim.AdamW(trainer.trainable(), lr=5e-5)

        def step(trainer=trainer, optimizer=optimizer, switches=switches):
            with checkpointed_blocks(model) if switches else contextlib.nullcontext():
                with torch.autocast(bench.device.type, dtype=torch.bfloat16):
                    loss = trainer(tokens).float()
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trainer.after_step()

        bench.row(shape, f"repair step ({len(heads)} heads, {label})", step, repeats=2)
        del trainer, optimizer
    if long:
        sequence = torch.randint(10, model.cfg.d_vocab, (1, long), device=tokens.device)
        bench.row(
            shape,
            f"long census (1 x {long:,} tokens)",
            lambda: hs.run_census(model, sequence, progress=False),
            repeats=1,
        )


def fused_rows(bench: Bench, shape: str, lengths: list[int]) -> None:
    """One layer's fused statistics against sdpa with the ALiBi mask, and their check."""
    n_heads = parse_shape(shape).n_heads
    d_head = parse_shape(shape).d_model // n_heads
    slopes = torch.tensor([2 ** (-8 * (h + 1) / n_heads) for h in range(n_heads)])
    for n_pos in lengths:
        generator = torch.Generator().manual_seed(n_pos)
        q, k, v = (torch.randn(1, n_pos, n_heads, d_head, generator=generator) for _ in "qkv")
        exact = attention_stats(*(t.double() for t in (q, k, v)), slopes.double())
        on = [t.to(bench.device) for t in (q, k, v, slopes)]
        try:
            got = attention_stats(*on, tolerance=FUSED_TOLERANCE)
            worst = max(
                float(((getattr(got, n).cpu() - getattr(exact, n)).abs()).max())
                / max(1.0, float(getattr(exact, n).abs().max()))
                for n in ("entropy", "distance", "max_weight", "bos_weight", "lse")
            )
            check = f"max rel. diff vs float64 {worst:.1e}"
        except Exception as error:  # noqa: BLE001 (the row records it)
            check = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
        bench.row(
            shape,
            f"fused stats, 1 x {n_pos:,} tokens ({check})",
            lambda on=on: attention_stats(*on, tolerance=FUSED_TOLERANCE),
        )
        t = torch.arange(n_pos, device=bench.device)
        distance = (t[:, None] - t[None, :]).float()
        mask = (-on[3][:, None, None] * distance).masked_fill(distance < 0, float("-inf"))
        heads = [x.transpose(1, 2) for x in on[:3]]
        bench.row(
            shape,
            f"sdpa + ALiBi mask, 1 x {n_pos:,} tokens",
            lambda heads=heads, mask=mask: torch.nn.functional.scaled_dot_product_attention(
                *heads, attn_mask=mask[None]
            ),
        )


def blindness_row(bench: Bench, shape: str, tokens: torch.Tensor) -> None:
    """Measured blindness: it needs a float32 model (it emulates the other dtypes' rounding)."""
    with torch.device(bench.device):
        hf = random_hf_bloom(parse_shape(shape), seed=0, dtype="float32")
    model = hs.backend.move(from_hf_model(hf, name=f"random-{shape}"), bench.device)
    dtypes = ["bfloat16", "float16"]
    bench.row(
        shape,
        "measured blindness (bfloat16, float16)",
        lambda: hs.measure_blindness(model, tokens, dtypes=dtypes, progress=False),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["bloom-560m", "bloom-1b7"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long", type=int, default=16384, help="0: no long-context row")
    parser.add_argument("--out", type=Path, default=ROOT / "figures/benchmarks/gpu.md")
    parser.add_argument("--fused-lengths", type=int, nargs="*", default=[2048, 8192])
    args = parser.parse_args()
    bench = Bench(args)
    for i, shape in enumerate(args.shapes):
        with torch.device(bench.device):  # random weights made on the device: fast
            hf = random_hf_bloom(parse_shape(shape), seed=0, dtype="bfloat16")
        shape_of = (args.batch_size, args.seq_len)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(10, hf.config.vocab_size, shape_of, generator=generator)
        tokens = tokens.to(bench.device)
        hf_rows(bench, shape, hf, tokens)
        model = from_hf_model(hf, name=f"random-{shape}")  # 4.x wraps hf itself: HF rows first
        model = hs.backend.move(model, bench.device)
        del hf
        tl_rows(bench, shape, model, tokens, args.long if i == 0 and args.long else None)
        del model
        blindness_row(bench, shape, tokens)
        fused_rows(bench, shape, args.fused_lengths)
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    print(args.out.read_text())
    print(f"{os.path.basename(__file__)}: done")


if __name__ == "__main__":
    main()
