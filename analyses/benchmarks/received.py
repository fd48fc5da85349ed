"""Benchmark: received mass and secondary sinks against a census of the same data.

Methods, all on the same token batches of one model (default: the bundled ``organism``):

* ``forward``          ``probes.stream`` with no hook (the forward the others share);
* ``census``           ``headsurgeon.run_census``;
* ``secondary_sinks``  ``headsurgeon.secondary_sinks`` (its own forward, one ``hook_pattern``
                       hook per layer);
* ``both``             one ``probes.stream`` with the census's hooks and ``ReceivedMass``'s:
                       what reading the received mass costs on top of a census pass.

Every method runs ``--repeats`` times in rotating order; the median wall and CPU (process)
time are reported, and each method's ratio to the census (the issue's goal: at most 1.2). On a
shared machine the CPU time is the steadier of the two.

    python analyses/benchmarks/received.py                          # organism, 4 x 8 x 256
    python analyses/benchmarks/received.py --model bloom-560m-shape --seq-len 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _shapes import parse_shape

from headsurgeon import load_model, run_census, secondary_sinks
from headsurgeon.loading import from_hf_model, random_hf_bloom
from headsurgeon.probes import HeadStats, stream
from headsurgeon.received import ReceivedMass

METHODS = ("forward", "census", "secondary_sinks", "both")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="organism", help="a model name, or SHAPE-shape")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model.endswith("-shape"):
        shape = parse_shape(args.model.removesuffix("-shape"))
        model = from_hf_model(random_hf_bloom(shape, seed=0), name=args.model)
    else:
        model = load_model(args.model)
    generator = torch.Generator().manual_seed(1)
    n = args.n_batches * args.batch_size
    tokens = torch.randint(10, model.cfg.d_vocab, (n, args.seq_len), generator=generator)
    common = {"batch_size": args.batch_size, "progress": False}

    def both() -> None:
        stats, mass = HeadStats(model), ReceivedMass(model, args.seq_len)
        stream(model, tokens, stats.hooks() + mass.hooks(), **common)
        stats.means(), mass.received()

    runs = {
        "forward": lambda: stream(model, tokens, [], **common),
        "census": lambda: run_census(model, tokens, **common),
        "secondary_sinks": lambda: secondary_sinks(model, tokens, **common),
        "both": both,
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in METHODS}
    for repeat in range(args.repeats + 1):  # the first round warms up
        order = METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)]
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            runs[name]()
            if repeat:
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    medians = {
        name: [statistics.median(t[i] for t in times[name]) for i in (0, 1)] for name in METHODS
    }
    wall_census, cpu_census = medians["census"]
    print(
        f"{args.model}: {n} sequences x {args.seq_len} tokens, batch {args.batch_size}, "
        f"{args.threads} thread(s), median of {args.repeats}"
    )
    for name, (wall, cpu) in medians.items():
        print(
            f"{name:>16}: wall {wall:7.3f} s ({wall / wall_census:4.2f} x census), "
            f"CPU {cpu:7.3f} s ({cpu / cpu_census:4.2f} x census)"
        )


if __name__ == "__main__":
    main()
