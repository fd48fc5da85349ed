"""Benchmark: long sequences in query blocks against one dense pass and Hugging Face, to 65,536.

Tasks, on one sequence of T random tokens (ids from 10 up) of the same model (default: the bundled
``organism``, 4 layers x 16 heads x 256; ``--shape`` for random weights of a BLOOM shape):

* ``forward``    one forward pass up to the last block's residual stream (no unembedding);
* ``census``     per-head attention statistics (``headsurgeon.run_census``);
* ``blindness``  measured underflow counts (``headsurgeon.blindness.measure_blindness``).

Methods:

* ``blocked``   the long-context path: ``block_size=None`` (blocks of query rows through the
                key-value cache, :mod:`headsurgeon.long_context`); forward: ``probes.stream``
                with no hooks;
* ``dense``     one pass over the whole sequence (``block_size=T``); forward: one
                ``run_to_layer`` call;
* ``hf-eager``  Hugging Face ``BloomForCausalLM`` from the same checkpoint (float32, CPU,
                ``attn_implementation="eager"``), its base model (no LM head, like the others);
                census: ``output_attentions=True`` and ``probes.pattern_stats`` on every returned
                pattern (the paper's way; it has no per-head output, so it computes less than the
                census); blindness: n/a (HF returns probabilities, not the logits the count needs);
* ``hf-sdpa``   the same with ``attn_implementation="sdpa"``, forward only: the floor a forward
                cannot beat, where ``transformers`` has it for BLOOM (5.x has not: the row then
                reads "error: ... does not support ... scaled_dot_product_attention").

Each (task, method, T) runs in a fresh process with ``--threads`` torch threads: it builds its
model, warms the method up on 128 tokens, then times ``--repeats`` runs at T (the median is
reported). Peak memory is the kernel's own high-water mark of resident memory (``VmHWM``, reset
through ``/proc/self/clear_refs`` after the warm-up; a 1 ms RSS sampler where that is refused):
the table shows it above the memory held just before the timed runs (model, tokens, warm-up
leftovers) and absolute. glibc's mmap threshold is fixed at 1 MiB, as in ``census.py``, so freed
tensors leave RSS; ``--keep-freed-memory`` runs the children as the command-line tools do instead
(faster, higher peaks). This process watches each child: above ``--max-memory-gib`` of RSS
(sampled every 5 ms) or past ``--timeout`` seconds it kills it and records "out of memory" or
"timeout". (An address-space limit, RLIMIT_AS, was tried: a one-thread organism process maps
2.4 GiB of address space for 0.5 GiB resident, libraries, thread stacks and malloc arenas, so the
limit would have to guess that slack; its allocation errors are still reported as out of memory.)
Once a method fails at some T for a task, larger T are skipped. Work still grows as T² on every
path (the blocked one saves memory, not attention entries): the organism's blocked census took
~23 s at 8,192 tokens on one thread, so ~25 min at 65,536, hence ``--timeout`` 3600 s; the whole
default run takes hours. Each child also spends ~10 s importing and loading.

Written (and rewritten after every run, so an interrupted run keeps what it measured): the
markdown report ``--out`` (command line, machine, date, every row, the largest T each method
reached, census / forward per T, blindness blocked vs dense), ``.csv`` beside it with the raw rows
and ``.json`` with the setup and rows (the census BOS masses and blindness zero fractions the
agreement columns come from included).

    python analyses/benchmarks/long_context.py                     # organism, 512 ... 65,536
    python analyses/benchmarks/long_context.py --lengths 512 1024 --tasks forward census
    python analyses/benchmarks/long_context.py --shape bloom-560m --lengths 512 2048 8192 \\
        --max-memory-gib 40 --threads 8 --out figures/benchmarks/long_context_560m.md
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _shapes import parse_shape
from census import RssSampler

from headsurgeon import long_context, run_census
from headsurgeon.blindness import measure_blindness
from headsurgeon.loading import from_hf_model, load_model, random_hf_bloom, resolve_model
from headsurgeon.probes import pattern_stats, stream

TASKS = ("forward", "census", "blindness")
METHODS = ("blocked", "dense", "hf-eager", "hf-sdpa")
APPLIES = {
    "forward": METHODS,
    "census": ("blocked", "dense", "hf-eager"),
    "blindness": ("blocked", "dense"),
}
LENGTHS = tuple(2**k for k in range(9, 17))  # 512 ... 65,536
WARMUP_TOKENS = 128
GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]
FIELDS = (
    "task",
    "method",
    "n_pos",
    "status",
    "time_s",
    "extra_gib",
    "peak_gib",
    "block",
    "times_s",
    "wall_s",
)


# --- the child: one (task, method, T) ---------------------------------------------------------


def build(args: argparse.Namespace, method: str) -> Any:
    """The HookedTransformer, or the Hugging Face model of the same weights for ``hf-*``."""
    if not method.startswith("hf-"):
        if args.shape:
            hf = random_hf_bloom(parse_shape(args.shape), seed=0)
            return from_hf_model(hf, name=f"random-{args.shape}")
        return load_model(args.model)
    from transformers import BloomForCausalLM

    impl = method.removeprefix("hf-")
    if args.shape:
        hf = random_hf_bloom(parse_shape(args.shape), seed=0)
        hf.set_attn_implementation(impl)  # transformers 5.25 keeps "eager" here, silently
    else:
        folder = resolve_model(args.model)[1]
        hf = BloomForCausalLM.from_pretrained(folder, attn_implementation=impl, dtype=torch.float32)
    if hf.config._attn_implementation != impl:
        raise ValueError(
            f"transformers runs BLOOM with {hf.config._attn_implementation} attention, not {impl}"
        )
    return hf.eval()


def sequence(n_pos: int, vocab: int) -> torch.Tensor:
    # Ids from 10 up avoid the special tokens (a leading pad would be masked).
    return torch.randint(10, vocab, (1, n_pos), generator=torch.Generator().manual_seed(1))


def runner(task: str, method: str, model: Any) -> Callable[[torch.Tensor], list[float] | None]:
    """``run(tokens)``: the method once; census and blindness return what the agreement columns
    compare (BOS mass per head; zero fraction per head and dtype)."""
    if method.startswith("hf-"):
        base = model.transformer  # no LM head: the others stop at the residual stream too

        def hf_run(tokens: torch.Tensor) -> list[float] | None:
            with torch.no_grad():
                out = base(tokens, output_attentions=task == "census", use_cache=False)
                if task != "census":
                    return None
                stats = [pattern_stats(p, 1) for p in out.attentions]  # [stat, batch, head]
            return torch.stack([s[0, 0] for s in stats]).flatten().tolist()

        return hf_run

    def block(tokens: torch.Tensor) -> int | None:
        return tokens.shape[1] if method == "dense" else None

    def tl_run(tokens: torch.Tensor) -> list[float] | None:
        if task == "forward":
            stream(model, tokens, [], batch_size=1, progress=False, block_size=block(tokens))
            return None
        if task == "census":
            df = run_census(model, tokens, batch_size=1, progress=False, block_size=block(tokens))
            return df["bos_mass"].tolist()
        measured = measure_blindness(
            model, tokens, batch_size=1, progress=False, block_size=block(tokens)
        )
        return measured.by_head["zero_fraction"].tolist()

    return tl_run


@contextlib.contextmanager
def recorded_blocks(seen: list[int]) -> Iterator[None]:
    """Record the block size of every ``long_context.run_in_blocks`` call (``stream`` calls it
    through the module), without touching the model or adding hooks."""
    original = long_context.run_in_blocks

    def wrapper(model, tokens, *, block_size, stop_at_layer=None):
        seen.append(block_size)
        return original(model, tokens, block_size=block_size, stop_at_layer=stop_at_layer)

    long_context.run_in_blocks = wrapper
    try:
        yield
    finally:
        long_context.run_in_blocks = original


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


@contextlib.contextmanager
def peak_memory(out: dict[str, int]) -> Iterator[None]:
    """``out["before"]``, ``out["peak"]``: resident bytes at the start and the peak within, from
    the kernel's high-water mark (reset here), or a 1 ms sampler where the reset is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        with RssSampler() as sampler:
            out["before"] = sampler.peak
            yield
        out["peak"] = sampler.peak
        return
    out["before"] = _status_kib("VmRSS")
    yield
    out["peak"] = max(_status_kib("VmHWM"), out["before"])


def out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return (
        isinstance(error, MemoryError)
        or "can't allocate memory" in text
        or ("not enough memory" in text)
    )


def measure(args: argparse.Namespace, task: str, method: str, n_pos: int) -> dict[str, Any]:
    """In this (fresh) process: build, warm up, then time ``--repeats`` runs at ``n_pos``."""
    if args.keep_freed_memory:
        from headsurgeon.allocator import keep_freed_memory

        keep_freed_memory()
    model = build(args, method)
    vocab = model.config.vocab_size if method.startswith("hf-") else model.cfg.d_vocab
    run = runner(task, method, model)
    run(sequence(min(WARMUP_TOKENS, n_pos), vocab))  # first-call allocations, lazy set-up
    tokens = sequence(n_pos, vocab)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    times, memory, blocks = [], {}, []
    with recorded_blocks(blocks), peak_memory(memory):
        for _ in range(args.repeats):
            start = time.perf_counter()
            check = run(tokens)
            times.append(time.perf_counter() - start)
    return {
        "status": "ok",
        "time_s": statistics.median(times),
        "times_s": times,
        "extra_gib": (memory["peak"] - memory["before"]) / GIB,
        "peak_gib": memory["peak"] / GIB,
        "block": blocks[0] if blocks else None,
        "check": check,
    }


def child_main(args: argparse.Namespace) -> None:
    task, method, n_pos = args.child[0], args.child[1], int(args.child[2])
    torch.set_num_threads(args.threads)
    try:
        result = measure(args, task, method, n_pos)
    except Exception as error:  # noqa: BLE001 (one line of why, for the table)
        line = (str(error).strip().splitlines() or [""])[0].split(". ")[0][:160]
        kind = "out of memory" if out_of_memory(error) else "error"
        result = {"status": f"{kind}: {type(error).__name__}: {line}"}
    print(json.dumps(result), flush=True)


# --- the parent: one child per row, watched -----------------------------------------------------


def child_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def run_child(args: argparse.Namespace, task: str, method: str, n_pos: int) -> dict[str, Any]:
    """Run one (task, method, T) in a fresh process, killed above the memory ceiling or past the
    time limit; a crash comes back as a status line."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), MALLOC_TRIM_THRESHOLD_="0")
    if args.keep_freed_memory:
        env = dict(os.environ)
    command = [sys.executable, __file__, *args.passthrough, "--child", task, method, str(n_pos)]
    ceiling, seen = args.max_memory_gib * GIB, 0
    start = time.monotonic()
    # Files, not pipes: a child that writes more than a pipe holds would block until the timeout.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env)
        killed = None
        while child.poll() is None:
            seen = max(seen, child_rss(child.pid))
            if seen > ceiling:
                killed = f"out of memory: RSS above {args.max_memory_gib:g} GiB, killed"
            elif time.monotonic() - start > args.timeout:
                killed = f"timeout: over {args.timeout:g} s, killed"
            if killed:
                child.kill()
                break
            time.sleep(0.005)
        child.wait()
        stdout, stderr = (f.seek(0) or f.read() for f in (out, err))
    wall = time.monotonic() - start
    if killed:
        return {"status": killed, "peak_gib": seen / GIB, "wall_s": wall}
    lines = stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        why = "killed (exit -9), likely out of memory" if child.returncode == -9 else "crashed"
        tail = (stderr.strip().splitlines() or [""])[-1][:160]
        return {"status": f"error: {why} (exit {child.returncode}): {tail}", "wall_s": wall}
    return {**json.loads(lines[-1]), "wall_s": wall}


def machine() -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    ram = "unknown"
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        ram = f"{kib * 1024 / GIB:.0f} GiB"
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "ram": ram,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformer_lens": version("transformer_lens"),
        "transformers": version("transformers"),
    }


# --- the report ---------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def ok(rows: dict, task: str, method: str, n_pos: int) -> dict | None:
    row = rows.get((task, method, n_pos))
    return row if row and row["status"] == "ok" else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else ""


def max_gap(a: dict | None, b: dict | None) -> str:
    if not (a and b and a.get("check") and b.get("check")):
        return ""
    return f"{max(abs(x - y) for x, y in zip(a['check'], b['check'], strict=True)):.1e}"


def rows_table(rows: list[dict]) -> list[str]:
    lines = [
        "| task | method | T | status | time (s) | extra peak (GiB) | process peak (GiB) | block |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['method']} | {r['n_pos']:,} | {r['status']} | "
            f"{fmt(r.get('time_s'))} | {fmt(r.get('extra_gib'))} | "
            f"{fmt(r.get('peak_gib'))} | {r.get('block') or ''} |"
        )
    return lines


def reached(rows: list[dict], args: argparse.Namespace) -> list[str]:
    """The largest T each (task, method) reached, and why it stopped."""
    lines = ["| task | method | largest T reached | stopped by |", "|---|---|---:|---|"]
    for task in args.tasks:
        for method in args.methods:
            if method not in APPLIES[task]:
                lines.append(f"| {task} | {method} | n/a | not applicable |")
                continue
            mine = [r for r in rows if r["task"] == task and r["method"] == method]
            done = [r["n_pos"] for r in mine if r["status"] == "ok"]
            failed = [r for r in mine if r["status"] != "ok" and not r["status"].startswith("sk")]
            best = f"{max(done):,}" if done else "none"
            why = f"T={failed[0]['n_pos']:,}: {failed[0]['status']}" if failed else ""
            lines.append(f"| {task} | {method} | {best} | {why} |")
    return lines


def census_vs_forward(rows: dict, lengths: list[int]) -> list[str]:
    lines = [
        "| T | blocked census (s) | blocked forward (s) | dense forward (s) | "
        "census / blocked forward | census / dense forward | "
        "max abs BOS mass gap: blocked vs dense | blocked vs hf-eager |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        c, bf = ok(rows, "census", "blocked", n), ok(rows, "forward", "blocked", n)
        df = ok(rows, "forward", "dense", n)
        t = {k: r and r["time_s"] for k, r in (("c", c), ("bf", bf), ("df", df))}
        gaps = [max_gap(c, ok(rows, "census", m, n)) for m in ("dense", "hf-eager")]
        lines.append(
            f"| {n:,} | {fmt(t['c'])} | {fmt(t['bf'])} | {fmt(t['df'])} | "
            f"{ratio(t['c'], t['bf'])} | {ratio(t['c'], t['df'])} | "
            f"{gaps[0]} | {gaps[1]} |"
        )
    return lines


def blindness_speedup(rows: dict, lengths: list[int]) -> list[str]:
    lines = [
        "| T | blocked (s) | dense (s) | dense / blocked time | blocked extra peak (GiB) | "
        "dense extra peak (GiB) | max abs zero-fraction gap |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        b, d = ok(rows, "blindness", "blocked", n), ok(rows, "blindness", "dense", n)
        lines.append(
            f"| {n:,} | {fmt(b and b['time_s'])} | {fmt(d and d['time_s'])} | "
            f"{ratio(d and d['time_s'], b and b['time_s'])} | "
            f"{fmt(b and b['extra_gib'])} | {fmt(d and d['extra_gib'])} | "
            f"{max_gap(b, d)} |"
        )
    return lines


def report(args: argparse.Namespace, rows: list[dict], info: dict, started: str) -> list[str]:
    by_key = {(r["task"], r["method"], r["n_pos"]): r for r in rows}
    model = f"random weights of {args.shape}" if args.shape else args.model
    lines = [
        f"# Long context: blocked vs dense vs Hugging Face ({model})",
        "",
        f"Command: `{args.command}`",
        "",
        f"Run {started}; {info['cpu']}, {info['ram']} RAM; Python {info['python']}, torch "
        f"{info['torch']}, TransformerLens {info['transformer_lens']}, transformers "
        f"{info['transformers']}. One sequence of T tokens, float32, CPU, {args.threads} torch "
        f"thread(s), median of {args.repeats} run(s) after a {WARMUP_TOKENS}-token warm-up, each "
        f"in a fresh process; limits {args.max_memory_gib:g} GiB RSS and {args.timeout:g} s. "
        "Extra peak: the high-water mark of resident memory above what the process held before "
        "the timed runs (model and tokens); block: query rows per block (T: one dense pass; "
        "blank for Hugging Face, one pass).",
        "",
        "## Largest T reached",
        "",
        *reached(rows, args),
    ]
    if "census" in args.tasks and "forward" in args.tasks:
        lines += [
            "",
            "## Census against a plain forward (the goal: census / forward <= 1)",
            "",
            *census_vs_forward(by_key, args.lengths),
        ]
    if "blindness" in args.tasks:
        lines += [
            "",
            "## Blindness: blocked against dense",
            "",
            *blindness_speedup(by_key, args.lengths),
        ]
    return [*lines, "", "## Every run", "", *rows_table(rows)]


def write(args: argparse.Namespace, rows: list[dict], info: dict, started: str) -> list[str]:
    lines = report(args, rows, info, started)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    setup = {k: v for k, v in vars(args).items() if k not in ("passthrough", "child")}
    payload = {"setup": setup, "machine": info, "date": started, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="organism", help="a name or folder load_model takes")
    parser.add_argument("--shape", help="random weights of a BLOOM shape instead (bloom-560m)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per row (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per row")
    parser.add_argument("--max-memory-gib", type=float, default=20, help="RSS ceiling per row")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="children keep freed buffers, as the CLI does",
    )
    parser.add_argument("--out", default=str(ROOT / "figures/benchmarks/long_context.md"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.passthrough = [
        "--model",
        args.model,
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    args.passthrough += ["--shape", args.shape] if args.shape else []
    args.passthrough += ["--keep-freed-memory"] if args.keep_freed_memory else []
    args.command = shlex.join(["python", os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    args.lengths = sorted(set(args.lengths))
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args)
        return
    info, started = machine(), datetime.datetime.now().isoformat(sep=" ", timespec="minutes")
    print(f"# long context: {args.command}", flush=True)
    rows: list[dict] = []
    failed: dict[tuple[str, str], int] = {}
    for n_pos in args.lengths:
        for task in args.tasks:
            for method in (m for m in args.methods if m in APPLIES[task]):
                row = {"task": task, "method": method, "n_pos": n_pos}
                if (task, method) in failed:
                    row["status"] = f"skipped: failed at T={failed[task, method]:,}"
                else:
                    row |= run_child(args, task, method, n_pos)
                    if row["status"] != "ok":
                        failed[task, method] = n_pos
                rows.append(row)
                took = (
                    f" {row['time_s']:.2f} s, +{row['extra_gib']:.2f} GiB"
                    if "time_s" in row
                    else ""
                )
                print(f"  {task} {method} T={n_pos}: {row['status']}{took}", flush=True)
                write(args, rows, info, started)
    print("\n".join(write(args, rows, info, started)))


if __name__ == "__main__":
    main()
