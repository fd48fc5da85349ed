"""Benchmark: the streaming census against the other ways of getting per-head attention metrics.

Methods, all on the same token batches of a random-weight model (default: bloom-560m's shape):

* ``forward``         a plain ``HookedTransformer`` forward (logits), the baseline;
* ``census``          ``headsurgeon.run_census`` (hooks reduce each layer, no unembedding);
* ``run_with_cache``  ``run_with_cache`` on each batch, then the same reductions from the cache;
* ``transformers``    Hugging Face ``BloomForCausalLM`` with ``output_attentions=True`` (the
                      surgery paper's method), the same pattern reductions; it has no per-head
                      output, so it computes less than the census (no output share).

Time: one process, every method timed ``--repeats`` times in rotating order on the same batches;
the median is reported. Peak memory on CPU: each method runs once in a fresh subprocess, which
builds its model, frees what it no longer needs and samples its resident memory every
millisecond while the method runs (glibc's mmap threshold is fixed so freed tensors leave RSS);
the table shows the peak above the memory held before the method started, and the absolute
peak. On CUDA the peak is ``torch.cuda.max_memory_allocated`` above the memory before the method.

    python analyses/benchmarks/census.py                      # bloom-560m shape, 2 batches of 8x128
    python analyses/benchmarks/census.py --shape bloom-1b7 --device cuda --batch-size 16
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
from _shapes import parse_shape

from headsurgeon import run_census
from headsurgeon.loading import from_hf_model, random_hf_bloom
from headsurgeon.probes import pattern_stats, write_norms

METHODS = ("forward", "census", "run_with_cache", "transformers")
GIB = 2**30


def build(args: argparse.Namespace, needs: set[str]):
    """The Hugging Face model (same seed, so the same weights) and/or its HookedTransformer."""
    hf = random_hf_bloom(parse_shape(args.shape), seed=0)
    tl = from_hf_model(hf, name=f"random-{args.shape}") if "tl" in needs else None
    tl = tl.to(args.device, print_details=False) if tl is not None else None
    if "hf" not in needs:
        del hf
        hf = None
    else:
        hf = hf.to(args.device)
    gc.collect()
    return hf, tl


def token_batches(args: argparse.Namespace, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    # Ids from 10 up avoid the special tokens (a leading pad would be masked).
    return torch.randint(
        10, vocab, (args.n_batches * args.batch_size, args.seq_len), generator=generator
    )


def reduce_cache(model, cache) -> None:
    """The census's reductions, from a full activation cache."""
    for layer in range(model.cfg.n_layers):
        pattern_stats(cache["pattern", layer], 1).double().sum(1)
        write_norms(cache["z", layer], model.blocks[layer].attn.W_O, 1).double().sum(0)
        (cache["attn_out", layer][:, 1:] - model.blocks[layer].attn.b_O).norm(dim=-1).sum()


def method_runner(name: str, hf, tl, tokens: torch.Tensor, args) -> Callable[[], None]:
    batches = tokens.split(args.batch_size)
    device = args.device

    def forward():
        for batch in batches:
            tl(batch.to(device))

    def census():
        run_census(tl, tokens, batch_size=args.batch_size, progress=False)

    def with_cache():
        for batch in batches:
            _, cache = tl.run_with_cache(batch.to(device))
            reduce_cache(tl, cache)
            del cache

    def transformers():
        for batch in batches:
            for pattern in hf(batch.to(device), output_attentions=True).attentions:
                pattern_stats(pattern, 1).double().sum(1)

    run = {"forward": forward, "census": census, "run_with_cache": with_cache}
    run["transformers"] = transformers
    body = run[name]

    def timed():
        with torch.no_grad():
            body()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return timed


def needs_of(name: str) -> set[str]:
    return {"hf"} if name == "transformers" else {"tl"}


class RssSampler:
    """Peak resident memory of this process, sampled every millisecond from /proc."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self):
        self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def measure_memory(args: argparse.Namespace, name: str) -> dict[str, float]:
    """In this (fresh) process: build, trim, then run ``name`` once while sampling memory."""
    hf, tl = build(args, needs_of(name))
    tokens = token_batches(args, parse_shape(args.shape).d_vocab)
    run = method_runner(name, hf, tl, tokens, args)
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        return {
            "extra": (torch.cuda.max_memory_allocated() - before) / GIB,
            "peak": torch.cuda.max_memory_allocated() / GIB,
        }
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return the construction's freed memory
    with RssSampler() as sampler:
        before = sampler.peak
        run()
    return {"extra": (sampler.peak - before) / GIB, "peak": sampler.peak / GIB}


def fresh_process(script: str, flag: str, name: str, passthrough: list[str]) -> dict:
    """Run ``script flag name ...`` in a new process and return the JSON it prints last, so each
    method's peak memory is its own; a crash (e.g. killed for memory) comes back as ``error``."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), MALLOC_TRIM_THRESHOLD_="0")
    command = [sys.executable, script, flag, name, *passthrough]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        why = "killed, likely out of memory" if result.returncode == -9 else "failed"
        print(result.stderr[-2000:], file=sys.stderr)
        return {"error": f"{why} (exit {result.returncode})"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def memory_in_subprocess(args: argparse.Namespace, name: str) -> dict[str, float]:
    result = fresh_process(__file__, "--memory-of", name, args.passthrough)
    if "error" in result:
        raise RuntimeError(f"memory run of {name} {result['error']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="bloom-560m", help="a BLOOM name, or e.g. 2x4x64")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per method")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--memory-of", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    args.passthrough = [a for a in sys.argv[1:] if a != "--memory-of"]
    torch.set_num_threads(args.threads)

    if args.memory_of:
        print(json.dumps(measure_memory(args, args.memory_of)))
        return

    setup = f"{args.n_batches} batches of {args.batch_size} x {args.seq_len} tokens"
    print(f"# census: {args.shape}, {setup}, {args.device}, {args.threads} thread(s)", flush=True)
    hf, tl = build(args, {"hf", "tl"})
    tokens = token_batches(args, tl.cfg.d_vocab)
    runners = {name: method_runner(name, hf, tl, tokens, args) for name in args.methods}
    for run in runners.values():  # warm up: first-call allocations and lazy initialisation
        run()
    times: dict[str, list[float]] = {name: [] for name in args.methods}
    for repeat in range(args.repeats):
        order = (
            args.methods[repeat % len(args.methods) :] + args.methods[: repeat % len(args.methods)]
        )
        for name in order:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
    # The methods agree: the census's BOS mass equals the transformers path's.
    if "transformers" in args.methods:
        with torch.no_grad():
            census = run_census(tl, tokens, batch_size=args.batch_size, progress=False)
            hf_bos = (
                torch.stack(
                    [
                        pattern_stats(p, 1)[0].double().mean(0)
                        for b in tokens.split(args.batch_size)
                        for p in hf(b.to(args.device), output_attentions=True).attentions
                    ]
                )
                .view(args.n_batches, tl.cfg.n_layers, -1)
                .mean(0)
            )
        gap = (torch.tensor(census["bos_mass"].to_numpy()) - hf_bos.flatten().cpu()).abs().max()
        print(f"  max |census - transformers| BOS mass: {gap.item():.2e}")
    del hf, tl, runners  # the runners hold the models: free them before the memory runs
    gc.collect()

    memory = {}
    for name in args.methods:
        memory[name] = (
            measure_memory(args, name)
            if args.device.startswith("cuda")
            else memory_in_subprocess(args, name)
        )
        print(f"  {name}: peak +{memory[name]['extra']:.2f} GiB", flush=True)

    base_t = statistics.median(times["forward"]) if "forward" in times else None
    base_m = memory["forward"]["extra"] if "forward" in memory else None
    lines = [
        "| method | time (s) | time / forward | extra peak memory (GiB) | / forward | "
        "process peak (GiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    results = {}
    for name in args.methods:
        t = statistics.median(times[name])
        m = memory[name]
        results[name] = {"time_s": t, "times_s": times[name], **m}
        lines.append(
            f"| {name} | {t:.2f} | {t / base_t:.2f}x | {m['extra']:.2f} | "
            f"{m['extra'] / base_m:.2f}x | {m['peak']:.2f} |"
            if base_t and base_m
            else f"| {name} | {t:.2f} | | {m['extra']:.2f} | | {m['peak']:.2f} |"
        )
    print("\n".join(lines))
    if "census" in results and "run_with_cache" in results:
        c, r = results["census"], results["run_with_cache"]
        print(
            f"census vs run_with_cache: {r['time_s'] / c['time_s']:.2f}x faster, "
            f"{r['extra'] / c['extra']:.2f}x less extra peak memory"
        )
    if args.out:
        setup = {k: v for k, v in vars(args).items() if k not in ("passthrough", "memory_of")}
        with open(args.out, "w") as f:
            json.dump({"setup": setup, "results": results, "table": lines}, f, indent=2)


if __name__ == "__main__":
    main()
