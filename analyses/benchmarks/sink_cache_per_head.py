"""Benchmark: the per-head sink-cache test with and without reusing the layers below each head.

``sink_cache_effect(model, tokens, sinks=[4], windows=[64], head_seq_len=None)`` (every head at
4 + 64, each in turn at 0 + 64) run ``--reps`` times each way, alternating, in one process: the
way before (every head's pass runs every layer from the tokens) and the way now (TransformerLens
3.x: each head's pass runs its layer and those above, from the base pass's kept residual stream).
Seconds are those of the base pass and the per-head passes (not the reference and the sweep),
wall and CPU; the two ``by_head`` tables must be equal bit for bit.

    OMP_NUM_THREADS=1 python analyses/benchmarks/sink_cache_per_head.py --model organism
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import headsurgeon as hs  # noqa: E402
import headsurgeon.sink_cache as sink_cache  # noqa: E402
from headsurgeon.backend import BACKEND  # noqa: E402
from headsurgeon.data import to_sequences  # noqa: E402

logger = logging.getLogger("sink_cache_per_head_benchmark")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="organism")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    if not type(BACKEND).resumes_at_layer:
        sys.exit("this TransformerLens major runs every layer per head: nothing to compare")
    model = hs.load_model(args.model)
    tokens = to_sequences(model, None, seq_len=args.seq_len, n_seqs=1).tokens
    passes: list[tuple[float, float]] = []  # (wall, CPU) seconds of each _cache_nll pass
    own = sink_cache._cache_nll

    def timed(*a, **kw):
        wall, cpu = time.perf_counter(), time.process_time()
        out = own(*a, **kw)
        passes.append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    sink_cache._cache_nll = timed
    seconds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    tables = {}
    for rep in range(args.reps):
        for reuse in (False, True):
            BACKEND.resumes_at_layer = reuse  # False: the way before, every layer per head
            passes.clear()
            effect = hs.sink_cache_effect(
                model, tokens, sinks=[4], windows=[64], head_seq_len=None, progress=False
            )
            per_head = passes[2:]  # the base pass and one pass per head
            seconds[reuse].append((sum(w for w, _ in per_head), sum(c for _, c in per_head)))
            tables[reuse] = effect.by_head
            logger.info(
                "rep %d, reuse %s: %.2f s wall, %.2f s CPU", rep, reuse, *seconds[reuse][-1]
            )
    BACKEND.resumes_at_layer = type(BACKEND).resumes_at_layer
    cfg = model.cfg
    logger.info(
        "%s, %d tokens, %d layers x %d heads, per-head test (median of %d):",
        args.model,
        args.seq_len,
        cfg.n_layers,
        cfg.n_heads,
        args.reps,
    )
    for i, what in enumerate(("wall", "CPU")):
        before = statistics.median(s[i] for s in seconds[False])
        now = statistics.median(s[i] for s in seconds[True])
        logger.info(
            "  %s: before %.2f s, now %.2f s, now/before %.3f", what, before, now, now / before
        )
    logger.info("by_head bit for bit the same: %s", tables[False].equals(tables[True]))


if __name__ == "__main__":
    main()
