"""One model, one thread at a time (issue 41, threads): a verb or a hooking block in one thread
refuses another thread's verb on the same model in one line, never lets it read a number the
first thread's hooks changed, and never blames the model; one thread nests freely, and threads
with their own copies run side by side."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import headsurgeon.census
from headsurgeon import ablate_heads, mitigation, perplexity, run_census
from headsurgeon.errors import HeadsurgeonError, ModelInUseError
from headsurgeon.inuse import holder, holding

TOKENS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def in_thread(call):
    """``call()`` run in a thread named ``worker``: ("ok", result) or ("error", exception)."""
    outcome = []

    def run():
        try:
            outcome.append(("ok", call()))
        except Exception as error:  # the test reads it
            outcome.append(("error", error))

    worker = threading.Thread(target=run, name="worker")
    worker.start()
    worker.join()
    return outcome[0]


def assert_refused(outcome, verb: str, holder_verb: str, thread: str) -> None:
    kind, error = outcome
    assert kind == "error" and isinstance(error, ModelInUseError), outcome
    message = str(error)
    assert "\n" not in message
    assert message.startswith(f"{verb}: the model is in use by {holder_verb} in thread {thread}")
    assert "copy.deepcopy(model)" in message
    assert "never fired" not in message and "organism" not in message


def test_a_mitigation_in_one_thread_refuses_perplexity_in_another(tiny_model):
    clean = perplexity(tiny_model, TOKENS, progress=False)
    with mitigation(tiny_model, "log"):
        mitigated = perplexity(tiny_model, TOKENS, progress=False)  # the same thread nests
        outcome = in_thread(lambda: perplexity(tiny_model, TOKENS, progress=False))
    assert mitigated != pytest.approx(clean)  # the block does change the number
    assert_refused(outcome, "perplexity", "mitigation", "MainThread")
    # The block has ended: the other thread runs, on the clean model.
    assert in_thread(lambda: perplexity(tiny_model, TOKENS, progress=False)) == ("ok", clean)
    assert holder(tiny_model) is None


def test_a_verb_in_another_thread_refuses_a_mitigation_block(tiny_model):
    def enter():
        with mitigation(tiny_model, "softcap", c=5.0):
            pass

    with holding(tiny_model, "run_census"):
        outcome = in_thread(enter)
    assert_refused(outcome, "mitigation", "run_census", "MainThread")
    assert not getattr(tiny_model, "headsurgeon_mitigations", [])  # nothing left half-entered


def test_two_censuses_of_one_model_in_two_threads(tiny_model, monkeypatch):
    serial = run_census(tiny_model, TOKENS, progress=False)
    started, go = threading.Event(), threading.Event()
    real_stream = headsurgeon.census.stream

    def paused_stream(*args, **kwargs):
        # The first census waits inside its hooks until the second has been answered.
        if threading.current_thread().name == "worker":
            started.set()
            go.wait(timeout=60)
        return real_stream(*args, **kwargs)

    monkeypatch.setattr(headsurgeon.census, "stream", paused_stream)
    outcome = []
    worker = threading.Thread(
        target=lambda: outcome.append(run_census(tiny_model, TOKENS, progress=False)),
        name="worker",
    )
    worker.start()
    assert started.wait(timeout=60)
    with pytest.raises(ModelInUseError) as refused:
        run_census(tiny_model, TOKENS, progress=False)
    go.set()
    worker.join()
    assert_refused(("error", refused.value), "run_census", "run_census", "worker")
    assert outcome[0].equals(serial)  # the census that ran is right


def test_censuses_racing_are_each_right_or_refused(tiny_model):
    serial = run_census(tiny_model, TOKENS, progress=False)
    outcomes: list = []

    def census():
        try:
            outcomes.append(run_census(tiny_model, TOKENS, progress=False))
        except HeadsurgeonError as error:
            outcomes.append(error)

    workers = [threading.Thread(target=census, name=f"census-{i}") for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for outcome in outcomes:
        assert isinstance(outcome, ModelInUseError) or outcome.equals(serial), outcome
    assert holder(tiny_model) is None


def test_one_thread_nests_verbs_inside_hooking_blocks(tiny_model):
    clean = run_census(tiny_model, TOKENS, progress=False)
    with ablate_heads(tiny_model, "L0H1", "zero"), mitigation(tiny_model, "log"):
        assert holder(tiny_model) == "ablate_heads in thread MainThread"
        inside = run_census(tiny_model, TOKENS, progress=False)
    assert not inside.equals(clean)
    assert holder(tiny_model) is None
    assert run_census(tiny_model, TOKENS, progress=False).equals(clean)


def test_threads_with_their_own_copies_run_side_by_side(tiny_model):
    clean = perplexity(tiny_model, TOKENS, progress=False)
    with mitigation(tiny_model, "log"):
        mitigated = perplexity(tiny_model, TOKENS, progress=False)
    copies = [copy.deepcopy(tiny_model) for _ in range(2)]
    results: dict = {}

    def measure(i: int) -> None:
        if i:
            results[i] = perplexity(copies[i], TOKENS, progress=False)
            return
        with mitigation(copies[i], "log"):
            results[i] = perplexity(copies[i], TOKENS, progress=False)

    workers = [threading.Thread(target=measure, args=(i,)) for i in range(2)]
    with ablate_heads(tiny_model, "L0H0", "zero"):  # the original, held here, blocks no copy
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert results == {0: mitigated, 1: clean}
