"""One model, one user, in asyncio tasks too (issue 51, class 6): a verb in one task while
another task's hooking block is open is refused in one line, as another thread's is; a model
pickles (torch.save) outside a block, and is refused in one line inside one."""

from __future__ import annotations

import asyncio
import copy
import io
import pickle

import pytest
import torch

from headsurgeon import ablate_heads, mitigation, perplexity, run_census
from headsurgeon.backend import MAJOR
from headsurgeon.errors import InvalidArgumentError, ModelInUseError
from headsurgeon.inuse import holder

TOKENS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def ppl(model) -> float:
    return perplexity(model, TOKENS, progress=False)


async def _block_and_other(model, other, *, create_inside: bool = False):
    """Task A holds a mitigation block open across an await; ``other`` runs in task B
    meanwhile (B made before the block, or inside it: then B inherits A's context)."""
    entered, done = asyncio.Event(), asyncio.Event()
    outcome = {}

    async def task_b():
        await entered.wait()
        try:
            outcome["b"] = ("ok", other())
        except Exception as error:  # the test reads it
            outcome["b"] = ("error", error)
        done.set()

    async def task_a():
        with mitigation(model, "log"):
            outcome["a inside"] = ppl(model)  # the block's own task nests
            b = asyncio.create_task(task_b(), name="task-b") if create_inside else None
            entered.set()
            await done.wait()
            if b is not None:
                await b

    if create_inside:
        await asyncio.create_task(task_a(), name="task-a")
    else:
        await asyncio.gather(
            asyncio.create_task(task_a(), name="task-a"),
            asyncio.create_task(task_b(), name="task-b"),
        )
    return outcome


def assert_refused(outcome, verb: str) -> None:
    kind, error = outcome
    assert kind == "error" and isinstance(error, ModelInUseError), outcome
    message = str(error)
    assert "\n" not in message
    assert message.startswith(
        f"{verb}: the model is in use by mitigation in asyncio task task-a in thread MainThread;"
    ), message
    assert "copy.deepcopy(model)" in message


@pytest.mark.parametrize("create_inside", [False, True], ids=["sibling", "child"])
def test_a_mitigation_in_one_task_refuses_perplexity_in_another(tiny_model, create_inside):
    clean = ppl(tiny_model)
    outcome = asyncio.run(
        _block_and_other(tiny_model, lambda: ppl(tiny_model), create_inside=create_inside)
    )
    assert outcome["a inside"] != pytest.approx(clean)  # the block does change the number
    assert_refused(outcome["b"], "perplexity")
    assert holder(tiny_model) is None
    assert ppl(tiny_model) == clean


def test_other_verbs_and_blocks_in_another_task_are_refused_too(tiny_model):
    def census():
        return run_census(tiny_model, TOKENS, progress=False)

    def block():
        with ablate_heads(tiny_model, "L0H0", "zero"):
            pass

    assert_refused(asyncio.run(_block_and_other(tiny_model, census))["b"], "run_census")
    assert_refused(asyncio.run(_block_and_other(tiny_model, block))["b"], "ablate_heads")


def test_a_block_entered_by_a_finished_task_belongs_to_its_thread(tiny_model):
    """A notebook enters a block by hand in one cell (one task) and measures in the next."""
    block = mitigation(tiny_model, "log")

    async def cell():
        block.__enter__()

    asyncio.run(cell())
    try:
        assert holder(tiny_model).startswith("mitigation in asyncio task")
        inside = ppl(tiny_model)  # the same thread, its task over: not refused
    finally:
        block.__exit__(None, None, None)
    assert holder(tiny_model) is None
    assert inside != pytest.approx(ppl(tiny_model))


def test_tasks_with_their_own_copies_run_side_by_side(tiny_model):
    clean = ppl(tiny_model)
    copied = copy.deepcopy(tiny_model)

    async def main():
        async def in_block():
            with mitigation(tiny_model, "log"):
                await asyncio.sleep(0.01)

        async def on_copy():
            return ppl(copied)

        return (await asyncio.gather(in_block(), on_copy()))[1]

    assert asyncio.run(main()) == pytest.approx(clean)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def test_the_hooks_headsurgeon_installs_pickle(tiny_model):
    """The exact-ALiBi hooks are classes, not closures, on both majors."""
    hooks = [h for block in tiny_model.blocks for h in block.attn._forward_pre_hooks.values()]
    assert hooks
    for hook in hooks:
        pickle.loads(pickle.dumps(hook))


@pytest.mark.skipif(
    MAJOR >= 4,
    reason="TransformerLens 4.x's own bridge holds classes local to its functions "
    "(AttentionBridge._setup_qkv_hook_reshaping), which nothing can pickle",
)
def test_torch_save_outside_a_block_reloads_with_equal_numbers(tiny_model):
    before = _logits(tiny_model)
    buffer = io.BytesIO()
    torch.save(tiny_model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(_logits(loaded), before)
    assert ppl(loaded) == ppl(tiny_model)
    with mitigation(loaded, "log"):  # its hooks are its own: the original stays free
        assert holder(tiny_model) is None
        assert ppl(loaded) != pytest.approx(ppl(tiny_model))
    assert torch.equal(pickle.loads(pickle.dumps(tiny_model))(TOKENS), before)


@pytest.mark.parametrize(
    "save",
    [
        lambda m: torch.save(m, io.BytesIO()),
        pickle.dumps,
        lambda m: pickle.dumps(m, protocol=2),
        copy.copy,
    ],
    ids=["torch.save", "pickle", "pickle protocol 2", "copy.copy"],
)
@pytest.mark.parametrize("block", ["mitigation", "ablate_heads"])
def test_saving_inside_a_block_is_refused_in_one_line(tiny_model, save, block):
    enter = (
        mitigation(tiny_model, "log")
        if block == "mitigation"
        else ablate_heads(tiny_model, "L0H0", "zero")
    )
    with enter, pytest.raises(InvalidArgumentError) as refused:
        save(tiny_model)
    message = str(refused.value)
    assert "\n" not in message
    assert f"inside the {block} block" in message and "after the block" in message
    assert "__reduce_ex__" not in tiny_model.__dict__  # lifted when the block ends
