"""Benchmark: peak memory of one repair step of a real BLOOM shape, by batch size and switch.

One masked fine-tuning step as ``python -m headsurgeon repair`` takes it (the ``slices``
strategy: float32 copies of the repaired heads' slices; AdamW; next-token loss; bfloat16
autocast), on random weights of a BLOOM shape (default bloom-1b7: 24 layers x 16 heads x 2048,
vocabulary 250,880) in ``--dtype`` (default bfloat16, the surgery paper's), on ``--seq-len``
tokens (default 512, the paper's windows), with the memory switches of
:class:`headsurgeon.finetune.FinetuneConfig`:

* ``default``       as fast as possible: every activation kept for the backward pass, the whole
                    batch's float32 logits (``batch x 512 x 250,880 x 4`` bytes: 0.5 GB per row)
                    and their log-softmax;
* ``checkpointing`` ``gradient_checkpointing=True``: blocks keep their inputs only and run again
                    in the backward pass;
* ``chunked``       ``loss_chunk=512``: the loss over 512 positions at a time, each chunk's
                    logits recomputed in the backward pass;
* ``both``          the two together.

The repaired heads default to the shallowest head of every layer (``L0-23H15`` on 1b7): the
backward pass runs through every block, the worst case for memory.

Each (switch, batch) runs in a fresh process: it builds the model, resets the kernel's resident
high-water mark (``VmHWM``), takes one step (optimiser state appears) and a second, timed one;
the peak is over both steps. "step" is the peak above the memory held before the first step (the
model and the batch), "peak" the absolute: on a GPU the same structure would show up in
``torch.cuda.max_memory_allocated`` without the CPU process's own ~0.5 GiB. This process kills a
child whose resident memory passes ``--ceiling-gib`` (the machine's other work survives) and
records it as out of memory; larger batches of that switch are then skipped.

    python analyses/benchmarks/repair_memory.py                    # bloom-1b7, batches 1 2 4 8
    python analyses/benchmarks/repair_memory.py --shape 4x8x256 --batches 1 2   # quick trial

Writes the markdown table ``--out`` (default ``figures/benchmarks/repair_memory.md``) and a JSON
beside it, rewritten after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _shapes import parse_shape
from long_context import child_rss, out_of_memory, peak_memory

from headsurgeon.finetune import checkpointed_blocks, make_trainer, next_token_loss
from headsurgeon.loading import random_model
from headsurgeon.surgery import HeadSet

SWITCHES = {
    "default": {},
    "checkpointing": {"gradient_checkpointing": True},
    "chunked": {"loss_chunk": 512},
    "both": {"gradient_checkpointing": True, "loss_chunk": 512},
}
GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]


def step_memory(args: argparse.Namespace, switch: str, batch: int) -> dict:
    """In this fresh process: build, then two steps under the high-water mark."""
    torch.set_num_threads(args.threads)
    settings = SWITCHES[switch]
    model = random_model(parse_shape(args.shape), dtype=args.dtype)
    heads = (
        HeadSet.parse(args.heads, model)
        if args.heads
        else HeadSet((layer, model.cfg.n_heads - 1) for layer in range(model.cfg.n_layers))
    )
    model.requires_grad_(False)
    objective = functools.partial(next_token_loss, chunk=settings.get("loss_chunk"))
    trainer = make_trainer(model, heads, objective)
    params = trainer.trainable()
    optimizer = torch.optim.AdamW(params, lr=5e-5)
    tokens = torch.randint(
        10, model.cfg.d_vocab, (batch, args.seq_len), generator=torch.Generator().manual_seed(0)
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    recompute = settings.get("gradient_checkpointing", False)
    memory: dict[str, int] = {}
    times = []
    with peak_memory(memory), checkpointed_blocks(model) if recompute else contextlib.nullcontext():
        for _ in range(2):
            start = time.perf_counter()
            with autocast:
                loss = trainer(tokens).float()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trainer.after_step()
            times.append(time.perf_counter() - start)
    return {
        "status": "ok",
        "time_s": times[-1],
        "step_gib": (memory["peak"] - memory["before"]) / GIB,
        "peak_gib": memory["peak"] / GIB,
        "before_gib": memory["before"] / GIB,
        "loss": loss.item(),
        "heads": str(heads),
        "params": sum(p.numel() for p in model.parameters()),
    }


def run_child(args: argparse.Namespace, switch: str, batch: int) -> dict:
    """One (switch, batch) in a fresh process, killed above the ceiling."""
    command = [sys.executable, __file__, *sys.argv[1:], "--child", switch, str(batch)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), MALLOC_TRIM_THRESHOLD_="0")
    seen, killed = 0, None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env)
        while child.poll() is None:
            seen = max(seen, child_rss(child.pid))
            if seen > args.ceiling_gib * GIB:
                killed = f"out of memory: above {args.ceiling_gib:g} GiB resident, killed"
                child.kill()
                break
            time.sleep(0.005)
        child.wait()
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        if killed:
            return {"status": killed, "seen_gib": seen / GIB}
        if child.returncode != 0 or not lines:
            tail = err.read().strip().splitlines()[-1:] or [f"exit {child.returncode}"]
            return {"status": f"error: {tail[0][:160]}"}
        return json.loads(lines[-1])


def table(args: argparse.Namespace, rows: list[dict]) -> str:
    lines = [
        f"# One repair step: {args.shape}, {args.dtype} weights, bfloat16 autocast, "
        f"batch x {args.seq_len} tokens, {args.threads} CPU thread(s)",
        "",
        f"`python analyses/benchmarks/repair_memory.py {' '.join(sys.argv[1:])}` (in parts: "
        "`--append`) on "
        f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}. Peak: resident memory (VmHWM) "
        "over two steps, CPU as the proxy for a GPU's allocated memory; step: above the "
        "model and batch held before it.",
        "",
        "| switches | batch | step (GiB) | peak (GiB) | time of step 2 (s) | status |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] == "ok":
            lines.append(
                f"| {r['switch']} | {r['batch']} | {r['step_gib']:.2f} | "
                f"{r['peak_gib']:.2f} | {r['time_s']:.1f} | ok |"
            )
        else:
            lines.append(f"| {r['switch']} | {r['batch']} | | | | {r['status']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="bloom-1b7", help="a BLOOM name, or e.g. 4x8x256")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--switches", nargs="+", choices=list(SWITCHES), default=list(SWITCHES))
    parser.add_argument("--heads", help="repaired heads (default: the last head of every layer)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ceiling-gib", type=float, default=18.0)
    parser.add_argument("--out", type=Path, default=ROOT / "figures/benchmarks/repair_memory.md")
    parser.add_argument(
        "--append", action="store_true", help="add to the rows of --out's JSON (a run in parts)"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        switch, batch = args.child[0], int(args.child[1])
        try:
            result = step_memory(args, switch, batch)
        except Exception as error:  # noqa: BLE001 (one line of why, for the table)
            kind = "out of memory" if out_of_memory(error) else "error"
            result = {"status": f"{kind}: {type(error).__name__}: {str(error)[:160]}"}
        print(json.dumps(result), flush=True)
        return
    saved = args.out.with_suffix(".json")
    rows = json.loads(saved.read_text())["rows"] if args.append and saved.exists() else []
    for switch in args.switches:
        for batch in sorted(args.batches):
            result = run_child(args, switch, batch) | {"switch": switch, "batch": batch}
            rows.append(result)
            print(json.dumps(result), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(table(args, rows))
            saved.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=2))
            if result["status"] != "ok":
                break  # larger batches of this switch need more


if __name__ == "__main__":
    main()
