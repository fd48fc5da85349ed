"""Benchmark: scoring retrieval candidates with a key-value cache against one long batch.

``passkey`` and ``needle`` score ``n_candidates`` answers after each prompt. Methods, on the
same prompt (random tokens) and candidates:

* ``batch``   every candidate appended to its own copy of the prompt, all in one batch (the
              previous implementation; cost grows with the number of candidates);
* ``cached``  ``headsurgeon.evals.retrieval.answer_scores``: the prompt once into a key-value
              cache, the candidates continue from it in one small batch.

Both give the same log-likelihoods (the largest difference is printed). Times are medians of
``--repeats`` runs in alternating order, one thread.

    python analyses/benchmarks/retrieval.py                          # organism-injured
    python analyses/benchmarks/retrieval.py --model DIR --lengths 512 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from headsurgeon import load_model
from headsurgeon.allocator import keep_freed_memory
from headsurgeon.evals.retrieval import answer_scores


@torch.no_grad()
def batch_scores(model, prompt: torch.Tensor, candidates: list[torch.Tensor]) -> torch.Tensor:
    """Log-likelihoods from one right-padded batch of prompt + candidate rows."""
    n, width = len(prompt), max(len(c) for c in candidates)
    batch = torch.zeros(len(candidates), n + width - 1, dtype=torch.long)
    for i, c in enumerate(candidates):
        batch[i, :n] = prompt
        batch[i, n : n + len(c) - 1] = c[:-1]
    logprobs = model(batch)[:, n - 1 :].float().log_softmax(-1)
    return torch.stack(
        [logprobs[i, : len(c)].gather(-1, c[:, None]).sum() for i, c in enumerate(candidates)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="organism-injured")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--candidates", type=int, default=10)
    parser.add_argument("--answer-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    model = load_model(args.model)
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.d_vocab
    print(f"{args.model}: {args.candidates} candidates of {args.answer_tokens} tokens")
    print("| prompt tokens | batch (s) | cached (s) | speed-up | max abs loglik difference |")
    print("|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        prompt = torch.randint(10, vocab, (length,), generator=gen)
        candidates = [
            torch.randint(10, vocab, (args.answer_tokens,), generator=gen)
            for _ in range(args.candidates)
        ]
        times: dict[str, list[float]] = {"batch": [], "cached": []}
        methods = {"batch": batch_scores, "cached": lambda *a: answer_scores(*a)[0]}
        results = {name: run(model, prompt, candidates) for name, run in methods.items()}  # warm-up
        for repeat in range(args.repeats):
            for name in sorted(methods, reverse=repeat % 2 == 1):
                start = time.perf_counter()
                methods[name](model, prompt, candidates)
                times[name].append(time.perf_counter() - start)
        batch_s, cached_s = (statistics.median(times[k]) for k in ("batch", "cached"))
        gap = (results["batch"] - results["cached"]).abs().max().item()
        speedup = batch_s / cached_s
        print(f"| {length} | {batch_s:.2f} | {cached_s:.2f} | {speedup:.1f}x | {gap:.1e} |")


if __name__ == "__main__":
    main()
