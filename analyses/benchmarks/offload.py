"""Benchmark: a census of a checkpoint several times larger than the memory it is given.

A random-weight BLOOM checkpoint of ``--shape`` (default bloom-1b7: 3.4 GB in float16) is written
once to ``--checkpoint`` (safetensors, as ``save_pretrained`` writes it). Then, each in a fresh
process, the same census (``headsurgeon.run_census`` on ``--n-seqs`` random sequences of
``--seq-len`` tokens) runs twice:

* ``offloaded``  ``load_model(..., max_memory={"cpu": --budget}, offload_folder=...)``: Accelerate
                 keeps what does not fit on disk (TransformerLens 4.x: ``from_pretrained`` reads
                 the checkpoint straight into that placement);
* ``whole``      ``load_model(...)`` with no limit, the reference;
* ``whole, freed memory returned``  the same after
                 :func:`headsurgeon.allocator.return_freed_memory`, the allocator setting a
                 load with a budget applies itself: the comparison of placements alone.

Peak memory is the process's resident high-water mark (``VmHWM``) from start to end, loading
included, and its anonymous part (resident less file-backed pages: the checkpoint's and the
offload copies' mapped pages are the kernel's to drop), sampled every millisecond; the two
censuses must agree exactly. Run it under either major: 4.x reads the checkpoint into the
placement, 3.x builds its model part by part (:mod:`headsurgeon.backend.bounded`).

    .venv4/bin/python analyses/benchmarks/offload.py                      # bloom-1b7, 1 GiB
    .venv/bin/python analyses/benchmarks/offload.py --shape 24x16x1024 --budget 300MiB
    .venv/bin/python analyses/benchmarks/offload.py --shape 4x8x256 --budget 2MB   # trial

Writes ``--out`` (default ``figures/benchmarks/offload.md``) and a JSON beside it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from _shapes import parse_shape
from census import RssSampler  # the benchmark beside this file
from long_context import _status_kib  # the benchmark beside this file

import headsurgeon as hs
from headsurgeon.allocator import return_freed_memory
from headsurgeon.backend import MAJOR
from headsurgeon.loading import random_hf_bloom

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
RETURNED = "whole, freed memory returned"


class AnonSampler(RssSampler):
    """Peak anonymous memory: resident less file-backed and shared pages (``statm``)."""

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            resident, shared = map(int, f.read().split()[1:3])
        return (resident - shared) * self._page


def child(args: argparse.Namespace, method: str) -> dict:
    torch.set_num_threads(args.threads)
    if method == RETURNED:
        return_freed_memory()
    start = time.perf_counter()
    with AnonSampler() as anon, tempfile.TemporaryDirectory(prefix="offload-bench-") as folder:
        placement = {"max_memory": {"cpu": args.budget}, "offload_folder": folder}
        model = hs.load_model(
            args.checkpoint, dtype=args.dtype, **(placement if method == "offloaded" else {})
        )
        loaded = time.perf_counter() - start
        offloaded = hs.backend.offloaded(model)
        tokens = torch.randint(
            10,
            model.cfg.d_vocab,
            (args.n_seqs, args.seq_len),
            generator=torch.Generator().manual_seed(0),
        )
        census = hs.run_census(model, tokens, progress=False)
    return {
        "method": method,
        "load_s": loaded,
        "total_s": time.perf_counter() - start,
        "peak_gib": _status_kib("VmHWM") / GIB,
        "peak_anon_gib": anon.peak / GIB,
        "offloaded_modules": len(offloaded),
        "census": census.to_json(orient="split"),
    }


def make_checkpoint(args: argparse.Namespace) -> float:
    """Write the random checkpoint once (skipped when its config is there); its size in GB."""
    folder = Path(args.checkpoint)
    if not (folder / "config.json").exists():
        print(f"writing a random {args.shape} checkpoint to {folder} ...", flush=True)
        hf = random_hf_bloom(parse_shape(args.shape), seed=0, dtype=args.dtype)
        hf.save_pretrained(folder, safe_serialization=True)
        del hf
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9


def run(args: argparse.Namespace, method: str) -> dict:
    command = [sys.executable, __file__, *sys.argv[1:], "--child", method]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"method": method, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="bloom-1b7")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--budget", default="1GiB", help="max_memory for the CPU")
    parser.add_argument("--checkpoint", help="default: one per shape and dtype in /tmp")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-seqs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "figures/benchmarks/offload.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.checkpoint is None:
        name = f"headsurgeon-bench-{args.shape}-{args.dtype}"
        args.checkpoint = os.path.join(tempfile.gettempdir(), name)
    if args.child:
        print(json.dumps(child(args, args.child)), flush=True)
        return
    size = make_checkpoint(args)
    rows = {m: run(args, m) for m in ("offloaded", "whole", RETURNED)}
    budget = hs.placement.check_placement(None, {"cpu": args.budget}, None, None).max_memory["cpu"]
    lines = [
        f"# Census of a {args.shape} checkpoint ({size:.2f} GB, {args.dtype}) in "
        f"{args.budget} of CPU memory",
        "",
        f"`python analyses/benchmarks/offload.py {' '.join(sys.argv[1:])}` under TransformerLens "
        f"{MAJOR}.x, {args.threads} thread(s), {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d')}; census of {args.n_seqs} x {args.seq_len} random tokens. "
        "Peak: the process's resident high-water mark, loading included; anonymous: its part "
        "not backed by files (sampled every ms).",
        "",
        "| method | peak (GiB) | peak / budget | peak anonymous (GiB) | anonymous / whole's "
        "| offloaded modules | load (s) | total (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    whole_anon = rows["whole"].get("peak_anon_gib")  # the ratio's reference: the default load
    for method, r in rows.items():
        if "error" in r:
            lines.append(f"| {method} | {r['error']} | | | | | | |")
            continue
        ratio = r["peak_gib"] * GIB / budget
        cells = [
            f"{r['peak_gib']:.2f}",
            f"{ratio:.2f}x",
            f"{r['peak_anon_gib']:.2f}",
            f"{r['peak_anon_gib'] / whole_anon:.2f}x" if whole_anon else "",
            r["offloaded_modules"],
            f"{r['load_s']:.0f}",
            f"{r['total_s']:.0f}",
        ]
        lines.append(f"| {method} | " + " | ".join(map(str, cells)) + " |")
    if all("census" in r for r in rows.values()):
        a, *others = (pd.read_json(io.StringIO(r["census"]), orient="split") for r in rows.values())
        numbers = a.select_dtypes("number").columns
        diff = max(float((a[numbers] - b[numbers]).abs().max().max()) for b in others)
        lines += ["", f"Largest census difference, offloaded vs each whole run: {diff:g}."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    slim = {m: {k: v for k, v in r.items() if k != "census"} for m, r in rows.items()}
    args.out.with_suffix(".json").write_text(
        json.dumps({"argv": sys.argv[1:], "rows": slim}, indent=2)
    )


if __name__ == "__main__":
    main()
