"""Check a ``python -m headsurgeon repair`` output folder against the organisms (the acceptance).

Reads ``OUT/report.json`` and ``OUT/model/`` and prints, as markdown:

* recovery: targeted and recovered heads, frozen-head drift (from the report);
* held-out perplexity of the uninjured organism, the injured input and the exported repaired
  model on the same windows (the bundled held-out corpora, BOS convention), and the repaired
  model's gap to the uninjured one;
* weight identity: every element of every tensor of the exported checkpoint against the input's,
  outside the repaired heads' Q/K/V rows and output-projection columns (BLOOM's fused layout).

    python -m headsurgeon repair organism-injured --out repaired
    python analyses/check_repair.py repaired
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _common import acceptance

from headsurgeon import HeadSet, load_model, perplexity
from headsurgeon.allocator import keep_freed_memory
from headsurgeon.checkpoint_diff import weight_changes
from headsurgeon.data import to_sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the repair CLI's output folder")
    parser.add_argument("--injured", default="organism-injured", help="the repair's input model")
    parser.add_argument("--reference", default="organism", help="the uninjured model")
    parser.add_argument("--n-seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(2)
    keep_freed_memory()

    for needed in (args.out / "report.json", args.out / "model" / "model.safetensors"):
        if not needed.is_file():
            raise SystemExit(f"error: {needed} is missing; pass a finished repair output folder")
    report = json.loads((args.out / "report.json").read_text())
    heads = HeadSet.parse(",".join(report["targeted"]))

    sources = {"uninjured": args.reference, "injured": args.injured, "repaired": args.out / "model"}
    windows, ppl = None, {}
    for name, source in sources.items():
        model = load_model(source)
        if windows is None:
            windows = to_sequences(
                model, None, seq_len=args.seq_len, n_seqs=args.n_seqs, prepend_bos=True
            ).tokens
        ppl[name] = perplexity(model, windows, window=args.seq_len, max_windows=None)
    changes = weight_changes(args.injured, args.out / "model", heads)
    a = acceptance(report, ppl, changes)

    print(
        f"- targeted {a['targeted']} heads ({heads}); recovered {a['recovered']} "
        f"({a['recovery_rate']:.0%}); frozen heads drifted: {a['drifted']}"
    )
    print(
        f"- held-out perplexity ({args.n_seqs} x {args.seq_len} tokens, BOS first): uninjured "
        f"{ppl['uninjured']:.2f}, injured {ppl['injured']:.2f}, repaired {ppl['repaired']:.2f} "
        f"({a['ppl_gap']:+.2%} vs uninjured)"
    )
    print(
        f"- weights: {len(changes)} tensors; {a['untouched_changed']} of {a['untouched']:,} "
        f"untouched elements differ from the input; {a['head_elements']:,} elements "
        "in the repaired slices"
    )


if __name__ == "__main__":
    main()
