"""Benchmark: peak memory of ``weight_changes`` on two checkpoint folders, lazy against eager.

Two Hugging Face BLOOM folders of the same random model (``--shape``, float32), the second with
``--heads`` re-initialised, are compared two ways, each in a fresh process:

* ``eager``  both ``model.safetensors`` read whole with ``safetensors.torch.load_file``, then
             compared as state dicts (what ``analyses/check_repair.py`` did before);
* ``lazy``   ``headsurgeon.checkpoint_diff.weight_changes`` on the folders: one tensor of each at a
             time.

Both must report the same changes. Memory: the peak resident set above the process's own before
the comparison (sampled every millisecond).

    python analyses/benchmarks/weight_changes.py                    # bloom-560m's shape
    python analyses/benchmarks/weight_changes.py --shape 4x16x256 --heads L2-3H9-15
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from census import RssSampler, fresh_process, parse_shape  # the census benchmark beside this file

from headsurgeon import HeadSet, reinit_heads, save_hf
from headsurgeon.checkpoint_diff import weight_changes
from headsurgeon.loading import random_model

GIB = 2**30


def compare(method: str, before: Path, after: Path, heads: HeadSet) -> dict:
    """In this (fresh) process: compare the two folders once, sampling memory."""
    from safetensors.torch import load_file

    d_head = json.loads((before / "config.json").read_text())
    d_head = d_head["hidden_size"] // d_head["n_head"]
    with RssSampler() as sampler:
        start, baseline = time.perf_counter(), sampler.peak
        if method == "eager":
            states = [load_file(str(folder / "model.safetensors")) for folder in (before, after)]
            table = weight_changes(*states, heads, d_head=d_head)
        else:
            table = weight_changes(before, after, heads)
        seconds = time.perf_counter() - start
    return {
        "extra_gib": (sampler.peak - baseline) / GIB,
        "seconds": seconds,
        "head_changed": int(table.head_changed.sum()),
        "other_changed": int(table.other_changed.sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="bloom-560m", help="BLOOM name or LAYERSxHEADSxWIDTH")
    parser.add_argument("--heads", default="L12-23H9-15", help="heads re-initialised in 'after'")
    parser.add_argument(
        "--compare", nargs=3, metavar=("METHOD", "BEFORE", "AFTER"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    heads = HeadSet.parse(args.heads)
    if args.compare:
        method, before, after = args.compare
        print(json.dumps(compare(method, Path(before), Path(after), heads)))
        return

    with tempfile.TemporaryDirectory(prefix="weight-changes-") as tmp:
        root = Path(tmp)
        model = random_model(parse_shape(args.shape), seed=0)
        save_hf(model, root / "before", overwrite=True)
        reinit_heads(model, heads, seed=1)
        save_hf(model, root / "after", overwrite=True)
        size = (root / "before" / "model.safetensors").stat().st_size / GIB
        del model
        print(f"{args.shape}: two float32 checkpoints of {size:.2f} GiB; heads {heads}")
        print("| method | extra peak memory | / eager | time | head / other elements changed |")
        print("|---|---:|---:|---:|---|")
        results = {}
        for method in ("eager", "lazy"):
            passthrough = [str(root / "before"), str(root / "after"), "--heads", args.heads]
            results[method] = r = fresh_process(__file__, "--compare", method, passthrough)
            if "error" in r:
                print(f"| {method} | {r['error']} | | | |")
                continue
            ratio = r["extra_gib"] / results["eager"]["extra_gib"]
            print(
                f"| {method} | {r['extra_gib']:.2f} GiB | {ratio:.2f}x | {r['seconds']:.1f} s "
                f"| {r['head_changed']:,} / {r['other_changed']:,} |"
            )


if __name__ == "__main__":
    main()
