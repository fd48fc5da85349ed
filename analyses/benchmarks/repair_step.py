"""Benchmark: one masked fine-tuning step against one full fine-tuning step, same model and batch.

Methods (AdamW, lr 5e-5, gradient clipping 1.0, next-token loss, one batch of random tokens):

* ``full``    every parameter trained (the baseline; HookedTransformer unties W_U from W_E);
* ``mask``    the surgery paper's gradient masks on the chosen layers' attention tensors, frozen
              elements restored after each step (``finetune(strategy="mask")``);
* ``slices``  only float32 copies of the chosen heads' slices are trained (``finetune``'s
              default): nothing below the lowest chosen layer needs gradient.

The repaired heads sit in the top half of the layers: by default layers L/2..L-1 and the
shallowest-slope heads 9H/16..H-1 (BLOOM-560m: L12-23 x H9-15, 84 heads, as in the paper).

Each method runs in a fresh subprocess: build the model, then, while sampling resident memory
every millisecond, set the method up, take one warm-up step (optimiser state appears) and
``--steps`` timed steps (median reported). "extra" is the peak above the memory held after
building the model. The optimiser state is measured from ``optimizer.state`` after the steps;
the sweep computes AdamW's state (two float32 moments per trained element) for other head counts
from the trained element count, without training.

    python analyses/benchmarks/repair_step.py                          # bloom-560m, random weights
    python analyses/benchmarks/repair_step.py --model organism-injured # a bundled organism
    python analyses/benchmarks/repair_step.py --model 4x8x256          # quick trial shape
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import time

import torch
from census import RssSampler, fresh_process, parse_shape  # the census benchmark beside this file

from headsurgeon.finetune import make_trainer
from headsurgeon.loading import BLOOM_SHAPES, load_model, random_model
from headsurgeon.surgery import HeadSet

METHODS = ("full", "mask", "slices")
GIB, MIB = 2**30, 2**20


def build(name: str, dtype: str):
    """A random-weight BLOOM of a named (or ``LxHxD``) shape, or a model ``load_model`` knows."""
    if name.lower() in BLOOM_SHAPES or "x" in name and all(p.isdigit() for p in name.split("x")):
        return random_model(parse_shape(name), dtype=dtype)
    return load_model(name, dtype=dtype)


def default_heads(n_layers: int, n_heads: int) -> HeadSet:
    """Top half of the layers x the shallowest-slope 7/16 of the heads."""
    return HeadSet(
        (layer, head)
        for layer in range(n_layers // 2, n_layers)
        for head in range(n_heads * 9 // 16, n_heads)
    )


def setup_step(method: str, model, heads: HeadSet):
    """(step function, optimiser, trained element count) for one method."""
    if method == "full":
        trainer, params = None, list(model.parameters())
    else:
        model.requires_grad_(False)
        trainer = make_trainer(model, heads, strategy=method)
        params = trainer.trainable()
    optimizer = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0)

    def step(batch: torch.Tensor) -> float:
        loss = model(batch, return_type="loss") if trainer is None else trainer(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if trainer is not None:
            trainer.after_step()
        return loss.item()

    return step, optimizer, sum(p.numel() for p in params)


def trained_elements(method: str, model, heads: HeadSet) -> int:
    """Elements the optimiser would see, without building an optimiser."""
    if method == "slices":
        return make_trainer(model, heads).params.numel()
    attn = model.blocks[0].attn
    per_layer = sum(getattr(attn, n).numel() for n in ("W_Q", "W_K", "W_V", "b_Q", "b_V", "W_O"))
    return per_layer * len(heads.layers)  # MaskTrainer's tensors: whole layers


def measure(args: argparse.Namespace, method: str) -> dict:
    """In this fresh process: build, then set up and step while sampling memory."""
    model = build(args.model, args.dtype)
    heads = (
        HeadSet.parse(args.heads, model)
        if args.heads
        else default_heads(model.cfg.n_layers, model.cfg.n_heads)
    )
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(
        10, model.cfg.d_vocab, (args.batch_size, args.seq_len), generator=generator
    )
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    times = []
    with RssSampler() as sampler:
        before = sampler.peak
        step, optimizer, n_trained = setup_step(method, model, heads)
        step(batch)  # warm-up: optimiser state and first-call allocations
        for _ in range(args.steps):
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    result = {
        "time_s": statistics.median(times),
        "times_s": times,
        "trained": n_trained,
        "optimizer_mib": state / MIB,
        "extra_gib": (sampler.peak - before) / GIB,
        "peak_gib": sampler.peak / GIB,
        "n_heads": len(heads),
        "heads": str(heads),
        "model_params": sum(p.numel() for p in model.parameters()),
    }
    if method != "full":
        n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
        top = list(HeadSet((i, h) for i in range(n_layers // 2, n_layers) for h in range(n_heads)))
        # One head, one whole layer, the benchmarked set, every head of the top half.
        sets = [HeadSet(top[:1]), HeadSet(top[:n_heads]), heads, HeadSet(top)]
        result["sweep"] = {
            f"{len(s)} ({s})" if len(s) <= n_heads else f"{len(s)} ({len(s.layers)} layers)": (
                trained_elements(method, model, s) * 2 * 4 / MIB
            )
            for s in sets
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="bloom-560m", help="BLOOM shape (random weights), LxHxD, or a model"
    )
    parser.add_argument("--heads", help="repaired heads (default: top half, shallow slopes)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--measure", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    args.passthrough = [a for a in sys.argv[1:] if a != "--measure"]
    torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(args, args.measure)))
        return

    print(
        f"# repair step: {args.model}, batch {args.batch_size} x {args.seq_len}, "
        f"{args.dtype}, {args.threads} thread(s)",
        flush=True,
    )
    results = {}
    for method in args.methods:
        results[method] = r = fresh_process(__file__, "--measure", method, args.passthrough)
        done = f"{r['time_s']:.2f} s/step, +{r['extra_gib']:.2f} GiB" if "error" not in r else ""
        print(f"  {method}: {done or r['error']}", flush=True)
    measured = {m: r for m, r in results.items() if "error" not in r}
    if not measured:
        raise SystemExit("every method failed")
    first = next(iter(measured.values()))
    print(
        f"model: {first['model_params'] / 1e6:.1f}M parameters; repaired heads: "
        f"{first['n_heads']} ({first['heads']})"
    )
    base = measured.get("full")
    lines = [
        "| method | trained elements | time / step (s) | / full | extra peak (GiB) | / full | "
        "optimiser state (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, r in results.items():
        if "error" in r:
            lines.append(f"| {method} | | {r['error']} | | | | |")
            continue
        ratio_t = f"{r['time_s'] / base['time_s']:.2f}x" if base else ""
        ratio_m = f"{r['extra_gib'] / base['extra_gib']:.2f}x" if base else ""
        lines.append(
            f"| {method} | {r['trained'] / 1e6:.2f}M | {r['time_s']:.2f} | {ratio_t} | "
            f"{r['extra_gib']:.2f} | {ratio_m} | {r['optimizer_mib']:.1f} |"
        )
    sweeps = {m: r["sweep"] for m, r in measured.items() if "sweep" in r}
    if sweeps:
        sizes = list(next(iter(sweeps.values())))
        lines += [
            "",
            "| repaired heads (top half) | "
            + " | ".join(f"{m} AdamW state (MiB)" for m in sweeps)
            + " |",
            "|---:|" + "---:|" * len(sweeps),
        ]
        for n in sizes:
            cells = [f"{sweeps[m][n]:.1f}" for m in sweeps]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if base:
        lines += ["", f"full fine-tuning AdamW state: {base['optimizer_mib']:.1f} MiB"]
    print("\n".join(lines))
    if args.out:
        setup = {k: v for k, v in vars(args).items() if k not in ("passthrough", "measure")}
        with open(args.out, "w") as f:
            json.dump({"setup": setup, "results": results, "table": lines}, f, indent=2)


if __name__ == "__main__":
    main()
