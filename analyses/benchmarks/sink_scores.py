"""Benchmark: what the standard scores (``sink_share``, ``ahon_ln``) add to the cost of a census.

Times :func:`headsurgeon.run_census` on the same token batches of a random-weight model (default:
bloom-560m's shape, 2 batches of 8 x 128 tokens, float32, as ``census.py``) with this working
tree's headsurgeon and with another revision's (default: ``73ee368``, the commit before the
scores), exported by ``git archive`` into a temporary folder. Each revision runs in its own
fresh process, the two alternating ``--rounds`` times; each process builds the model, runs one
small census to warm up, then times ``--repeats`` censuses. Reported: the median and the fastest
census time of each revision and their ratios to the revision before (the goal of issue 39: at
most 1.2x), each process's peak resident memory, and the machine's load average (on shared,
busy cores the fastest run is the least disturbed one).

    python analyses/benchmarks/sink_scores.py                        # bloom-560m shape
    python analyses/benchmarks/sink_scores.py --shape 4x16x256 --write   # quick; writes
                                                      # figures/benchmarks/sink_scores.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "benchmarks"


def child(args: argparse.Namespace) -> None:
    """One process: build the model, warm up, time ``args.repeats`` censuses; print JSON."""
    import torch
    from _shapes import parse_shape

    import headsurgeon
    from headsurgeon import run_census
    from headsurgeon.loading import from_hf_model, random_hf_bloom

    torch.set_num_threads(args.threads)
    hf = random_hf_bloom(parse_shape(args.shape), seed=0)
    model = from_hf_model(hf, name=f"random-{args.shape}")
    del hf
    generator = torch.Generator().manual_seed(1)
    n_seqs = args.n_batches * args.batch_size
    tokens = torch.randint(10, model.cfg.d_vocab, (n_seqs, args.seq_len), generator=generator)
    run_census(model, tokens[:1, :16], progress=False)  # warm-up: first-call allocations
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        census = run_census(model, tokens, batch_size=args.batch_size, progress=False)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # KiB on Linux
    print(
        json.dumps(
            {
                "times": times,
                "peak_gib": peak,
                "columns": list(census.columns),
                "package": str(Path(headsurgeon.__file__).parent),
            }
        )
    )


def run_child(args: argparse.Namespace, tree: Path) -> dict:
    """Run this script's child mode with ``tree``'s headsurgeon first on the path."""
    argv = [sys.executable, __file__, "--child", "--shape", args.shape]
    for name in ("seq_len", "batch_size", "n_batches", "repeats", "threads"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = os.environ | {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="bloom-560m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n-batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="censuses timed per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per revision")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", default="73ee368", help="the revision to compare with")
    parser.add_argument("--write", action="store_true", help="write figures/benchmarks/")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "headsurgeon"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        trees = {"with scores": ROOT, f"before ({args.baseline})": Path(tmp)}
        results = {name: [] for name in trees}
        loads = [os.getloadavg()[0]]
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                results[name].append(run_child(args, tree))
                print(f"round {round_ + 1}: {name}: {results[name][-1]['times']}", flush=True)
                loads.append(os.getloadavg()[0])
    medians = {
        name: statistics.median(t for r in runs for t in r["times"])
        for name, runs in results.items()
    }
    fastest = {name: min(t for r in runs for t in r["times"]) for name, runs in results.items()}
    ours, before = medians.values()
    fastest_before = list(fastest.values())[1]
    assert {"sink_share", "ahon_ln"} <= set(results["with scores"][0]["columns"])
    rows = [
        f"| {name} | {medians[name]:.2f} s | {medians[name] / before:.3f}x | "
        f"{fastest[name]:.2f} s | {fastest[name] / fastest_before:.3f}x | "
        f"{max(r['peak_gib'] for r in runs):.2f} GiB |"
        for name, runs in results.items()
    ]
    setting = (
        f"random weights of {args.shape}'s shape, {args.n_batches} batches of {args.batch_size} "
        f"x {args.seq_len} tokens, float32, {args.threads} thread(s), CPU; median of "
        f"{args.rounds * args.repeats} censuses per revision in {args.rounds} alternating fresh "
        f"processes; 1-minute load average {min(loads):.1f}-{max(loads):.1f} on "
        f"{os.cpu_count()} CPU(s)"
    )
    table = "\n".join(
        [
            f"Census with the standard scores against the census before them ({setting}):",
            "",
            "| census | median | / before | fastest | / before | process peak |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Cost of the scores: {ours / before:.3f}x the census before them by the median, "
            f"{fastest['with scores'] / fastest_before:.3f}x by the fastest run "
            "(goal: <= 1.2x).",
        ]
    )
    print(table)
    if args.write:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "sink_scores.md").write_text(table + "\n")
        record = {"setting": setting, "medians": medians, "fastest": fastest, "runs": results}
        (OUT / "sink_scores.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
