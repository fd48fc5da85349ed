"""Masked fine-tuning: frozen weights stay frozen, resume after a kill, NaN, DDP, planting."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import head_weight

from headsurgeon.backend.weights import head_tensors, tl_state_dict
from headsurgeon.errors import CheckpointError, DataError, InvalidArgumentError, OutputExistsError
from headsurgeon.finetune import (
    FinetuneConfig,
    TrainingDivergedError,
    bos_mass_objective,
    checkpointed_blocks,
    finetune,
    make_trainer,
    next_token_loss,
)
from headsurgeon.finetune.checkpoint import CHECKPOINT_FILE, load_checkpoint
from headsurgeon.finetune.objectives import head_bos_mass
from headsurgeon.loading import ModelShape, random_model
from headsurgeon.progress import RunBar
from headsurgeon.surgery import HeadSet, mask_gradients, reinit_heads

TESTS = Path(__file__).parent
SHAPE = ModelShape(n_layers=3, n_heads=4, d_model=32, d_vocab=64, n_ctx=32)
HEADS = "L1H1,L2H2-3"


def setup(heads: str = HEADS):
    """A reproducible model with re-initialised heads and random training tokens."""
    model = random_model(SHAPE, seed=0)
    chosen = HeadSet.parse(heads, model)
    reinit_heads(model, chosen, seed=1)
    tokens = torch.randint(0, SHAPE.d_vocab, (24, 16), generator=torch.Generator().manual_seed(0))
    return model, chosen, tokens


def config(**kwargs) -> FinetuneConfig:
    base = dict(steps=6, lr=1e-2, weight_decay=0.1, batch_size=4, eval_every=3)
    return FinetuneConfig(**(base | kwargs))


def snapshot(model) -> dict[str, torch.Tensor]:
    """Every parameter by ``named_parameters`` name (on 4.x the bridge's own q/k/v/o weights and
    its unused fused qkv copy too)."""
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def head_view(model, params: dict[str, torch.Tensor], layer: int, name: str) -> torch.Tensor:
    """Tensor ``name`` (``W_Q`` ...) of ``layer`` in a :func:`snapshot`, heads first."""
    tensor = head_tensors(model, layer)[name]
    return tensor.heads(params[tensor.path])


def outside(model, before, heads) -> list[str]:
    """Names of parameters whose elements outside the chosen heads' slices differ from ``before``
    (a :func:`snapshot`): every parameter of the model is compared, on either major."""
    sliced = {
        tensor.path: (tensor, chosen)
        for layer, chosen in HeadSet.of(heads).by_layer().items()
        for tensor in head_tensors(model, layer).values()
    }
    moved = []
    for name, p in model.named_parameters():
        diff = p.detach() != before[name]
        if name in sliced:
            tensor, chosen = sliced[name]
            tensor.heads(diff)[chosen] = False
        if diff.any():
            moved.append(name)
    return moved


@pytest.mark.parametrize(
    "strategy, autocast", [("slices", None), ("mask", None), ("slices", "bfloat16")]
)
def test_frozen_weights_stay_bit_identical_with_weight_decay(strategy, autocast):
    model, heads, tokens = setup()
    before = snapshot(model)
    finetune(
        model, heads, tokens, config=config(strategy=strategy, autocast=autocast), progress=False
    )
    assert outside(model, before, heads) == []
    assert not torch.equal(head_weight(model, 2, "W_O")[3], head_view(model, before, 2, "W_O")[3])
    assert torch.all(head_weight(model, 2, "b_K")[3] == 0)  # no gradient: not trained
    assert all(p.requires_grad for p in model.parameters())  # restored afterwards


def test_chunked_loss_equals_the_whole_loss_and_its_gradient():
    model, _, tokens = setup()
    batch = tokens[:5]
    whole = next_token_loss(model, batch)
    for chunk in (1, 7, 75, 1000):  # one position, ragged, exact, more than there are
        assert torch.allclose(next_token_loss(model, batch, chunk=chunk), whole, atol=1e-6)
    W_O = head_tensors(model, 2)["W_O"].param
    W_O.requires_grad_(True)
    (expected,) = torch.autograd.grad(next_token_loss(model, batch), W_O)
    (chunked,) = torch.autograd.grad(next_token_loss(model, batch, chunk=9), W_O)
    assert expected.abs().max() > 0
    assert torch.allclose(chunked, expected, atol=1e-6)


@pytest.mark.parametrize("strategy", ["slices", "mask"])
def test_memory_switches_train_the_same_heads_the_same_way(strategy):
    runs = []
    for switches in ({}, {"gradient_checkpointing": True, "loss_chunk": 10}):
        model, heads, tokens = setup("L0H1,L2H3")  # backward through every block
        before = snapshot(model)
        result = finetune(
            model, heads, tokens, config=config(strategy=strategy, **switches), progress=False
        )
        assert outside(model, before, heads) == []
        runs.append((result.losses, head_weight(model, 0, "W_Q")[1].clone(), model))
    (losses, trained, _), (losses2, trained2, model) = runs
    assert losses2 == pytest.approx(losses, abs=1e-5)
    assert torch.allclose(trained2, trained, atol=1e-5)
    assert not any("forward" in vars(block) for block in model.blocks)  # the class's again


def test_checkpointed_blocks_keep_only_block_inputs():
    model, heads, tokens = setup("L0H1")
    model.requires_grad_(False)
    trainer = make_trainer(model, heads)
    saved = {}
    for recompute in (False, True):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with checkpointed_blocks(model) if recompute else contextlib.nullcontext():
                loss = trainer(tokens[:4])
        loss.backward()
        saved[recompute] = sum(sizes)
    assert saved[True] < saved[False] / 2


def test_naive_gradient_mask_with_adamw_moves_frozen_weights():
    """Why finetune needs more than gradient masks: decoupled weight decay moves everything."""
    model, heads, tokens = setup()
    before = snapshot(model)
    with mask_gradients(model, heads):
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            next_token_loss(model, tokens[:4]).backward()
            optimizer.step()
            optimizer.zero_grad()
    moved = outside(model, before, heads)

    def path(layer, name):
        return head_tensors(model, layer)[name].path

    assert path(1, "W_Q") in moved and path(2, "W_O") in moved
    assert path(0, "W_Q") not in moved  # no chosen head there: requires_grad=False


def test_no_backward_below_lowest_repaired_layer():
    model, heads, tokens = setup("L2H0")
    calls = []
    for layer in range(SHAPE.n_layers):
        for name in ("hook_attn_out", "hook_resid_post"):
            # By the name asked for: 4.x's hook points answer to other names (blocks.2.hook_out).
            def record(grad, hook, asked=f"blocks.{layer}.{name}"):
                calls.append(asked)

            model.add_hook(f"blocks.{layer}.{name}", record, dir="bwd")
    finetune(model, heads, tokens, config=config(steps=2), progress=False)
    model.reset_hooks()
    assert set(calls) == {"blocks.2.hook_attn_out", "blocks.2.hook_resid_post"}
    assert all(p.grad is None for p in model.parameters())


def test_grad_accumulation_matches_a_larger_batch():
    results = []
    for batch_size, grad_accum in [(8, 1), (4, 2)]:
        model, heads, tokens = setup()
        finetune(
            model,
            heads,
            tokens,
            config=config(batch_size=batch_size, grad_accum=grad_accum),
            progress=False,
        )
        results.append(snapshot(model))
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-5, atol=1e-6)


def test_history_and_schedule():
    model, heads, tokens = setup()
    result = finetune(
        model,
        heads,
        tokens,
        eval_data=tokens[:8],
        config=config(steps=6, warmup_steps=2),
        progress=False,
    )
    history = result.history
    assert history["step"].tolist() == [0, 3, 6]
    assert {"train_loss", "train_ppl", "heldout_ppl", "bos_mass", "bos_mass_max"} <= set(history)
    assert len(result.losses) == 6 and result.steps_done == 6 and not result.stopped_early
    assert history["lr"].iloc[0] == pytest.approx(0.5e-2)  # warm-up step 1 of 2


KILLED_RUN = """
import sys, time
import torch
sys.path[:0] = {tests!r}
from test_finetune import config, setup
from headsurgeon.finetune import finetune, next_token_loss

def slow_loss(model, tokens):  # room for the parent to kill the run between checkpoints
    time.sleep(0.05)
    return next_token_loss(model, tokens)

model, heads, tokens = setup()
finetune(model, heads, tokens, config=config(steps=20, checkpoint_every=2, eval_every=10),
         objective=slow_loss, checkpoint_dir={ckpt!r}, progress=False)
"""


@pytest.mark.slow  # a subprocess
def test_resume_after_kill_is_bit_identical(tmp_path):
    ckpt = tmp_path / "ckpt"
    script = KILLED_RUN.format(tests=[str(TESTS), str(TESTS.parent)], ckpt=str(ckpt))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    killed_at = None
    while time.monotonic() < deadline and proc.poll() is None:
        state = load_checkpoint(ckpt) if (ckpt / CHECKPOINT_FILE).exists() else None
        if state is not None and state["step"] >= 4:
            os.kill(proc.pid, signal.SIGKILL)
            killed_at = state["step"]
            break
        time.sleep(0.02)
    proc.wait()
    assert killed_at is not None, proc.stderr.read().decode()[-2000:]
    assert load_checkpoint(ckpt)["step"] < 20  # really interrupted

    model, heads, tokens = setup()
    resumed = finetune(
        model,
        heads,
        tokens,
        config=config(steps=20, checkpoint_every=2, eval_every=10),
        checkpoint_dir=ckpt,
        resume=True,
        progress=False,
    )
    assert 4 <= resumed.resumed_from < 20 and resumed.steps_done == 20
    reference, heads, tokens = setup()
    straight = finetune(
        reference, heads, tokens, config=config(steps=20, eval_every=10), progress=False
    )
    for name, value in snapshot(reference).items():
        assert torch.equal(model.get_parameter(name), value), name
    assert resumed.losses == straight.losses

    other, other_heads, tokens = setup("L1H1")
    with pytest.raises(CheckpointError, match="different heads"):
        finetune(
            other,
            other_heads,
            tokens,
            config=config(steps=20, eval_every=10),
            checkpoint_dir=ckpt,
            resume=True,
            progress=False,
        )
    with pytest.raises(CheckpointError, match="different config"):
        finetune(
            model,
            heads,
            tokens,
            config=config(steps=20, eval_every=10, lr=2e-2),
            checkpoint_dir=ckpt,
            resume=True,
            progress=False,
        )


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, caplog):
    model, heads, tokens = setup()
    before = snapshot(model)
    calls = []

    def breaks_at_step_5(model, tokens):
        calls.append(1)
        loss = next_token_loss(model, tokens)
        return loss * float("nan") if len(calls) == 5 else loss

    diverged = r"loss nan .* at step 5.*weights from before fine-tuning.*\(step 4\) is kept"
    with pytest.raises(TrainingDivergedError, match=diverged):
        finetune(
            model,
            heads,
            tokens,
            config=config(steps=8, checkpoint_every=2),
            objective=breaks_at_step_5,
            checkpoint_dir=tmp_path,
            progress=False,
        )
    # A failed call gives the model back as it was, bit for bit, and says so in one line.
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    restored = [r.getMessage() for r in caplog.records if "are back as they were" in r.getMessage()]
    assert restored == [
        "fine-tuning stopped (TrainingDivergedError): the model's weights are back as they were "
        "before it"
    ]
    kept = load_checkpoint(tmp_path)
    assert kept["step"] == 4
    with pytest.raises(OutputExistsError, match="holds a checkpoint"):  # never overwritten
        finetune(
            model, heads, tokens, config=config(steps=8), checkpoint_dir=tmp_path, progress=False
        )
    reference, heads, tokens = setup()
    finetune(reference, heads, tokens, config=config(steps=8), progress=False)
    # The model keeps the weights of the last good step: four steps of the same schedule.
    partial, heads, tokens = setup()
    finetune(
        partial,
        heads,
        tokens,
        config=config(steps=8, checkpoint_every=2),
        checkpoint_dir=tmp_path,
        resume=True,
        progress=False,
    )
    assert torch.equal(partial.blocks[2].attn.W_O, reference.blocks[2].attn.W_O)


def test_bos_mass_objective_plants_a_sink():
    model, heads, tokens = setup("L2H3")
    tokens[:, 0] = 1  # a fixed first token, like a BOS token
    before = snapshot(model)
    assert head_bos_mass(model, tokens, heads).item() < 0.2
    finetune(
        model,
        heads,
        tokens,
        objective=bos_mass_objective(heads, target=0.8),
        config=config(steps=40, lr=1e-1, eval_every=40),
        progress=False,
    )
    mass = head_bos_mass(model, tokens, heads).item()
    assert 0.6 < mass < 0.95  # a BOS sink of roughly the chosen strength
    assert outside(model, before, heads) == []


def test_the_duration_is_told_as_a_range_after_the_first_five_steps(caplog):
    model, heads, tokens = setup()
    with caplog.at_level(logging.INFO, logger="headsurgeon"):
        finetune(model, heads, tokens, eval_data=tokens[:8], config=config(), progress=True)
    messages = [r.getMessage() for r in caplog.records]
    told = next(i for i, m in enumerate(messages) if m.startswith("fine-tuning 3 heads: about"))
    assert messages[told - 1].startswith("step 3:") and messages[told + 1].startswith("step 6:")
    assert "from 5 timed steps (median to 90th percentile) (1 step of " in messages[told]
    low, high = map(float, messages[told].split("1 step of ")[1].split(" s")[0].split("-"))
    assert 0 < low <= high
    assert ", 1 evaluation of " in messages[told]


def test_its_lines_show_where_logging_is_not_set_up_and_nowhere_else(monkeypatch, capsys):
    """A notebook that never set up logging sees the estimate and the evaluations on stderr
    (Python alone shows no INFO line); a program that set up logging gets them only there."""
    model, heads, tokens = setup()
    monkeypatch.setattr(logging.root, "handlers", [])  # pytest's own capture: not a user's
    package = logging.getLogger("headsurgeon")
    monkeypatch.setattr(package, "level", logging.NOTSET)
    finetune(model, heads, tokens, config=config(), progress=False)
    err = capsys.readouterr().err
    assert "fine-tuning 3 heads: about" in err and "step 0: perplexity on the fine-tuning's" in err
    assert package.handlers == [] and package.level == logging.NOTSET  # nothing stays
    logging.root.handlers = [logging.NullHandler()]  # the program's own set-up
    finetune(model, heads, tokens, config=config(), progress=False)
    assert "step 0" not in capsys.readouterr().err


def test_a_callers_bar_counts_the_steps_run_and_drops_those_an_early_stop_skips():
    model, heads, tokens = setup("L2H3")
    cfg = config(steps=40, lr=5e-2, eval_every=2, patience=2)
    bar = RunBar({"step": 40, "evaluation": cfg.evaluations}, disable=True)
    result = finetune(
        model,
        heads,
        tokens,
        eval_data=tokens[16:],
        objective=bos_mass_objective(heads),
        progress=bar,
        config=cfg,
    )
    assert result.stopped_early and bar.n == bar.total == result.steps_done < 40
    assert bar.plan["evaluation"] == len(result.history) and bar.left == {
        "step": 0,
        "evaluation": 0,
    }


def test_early_stopping_restores_best(tmp_path):
    model, heads, tokens = setup("L2H3")
    # Planting a sink makes held-out next-token loss worse: training stops early.
    result = finetune(
        model,
        heads,
        tokens,
        eval_data=tokens[16:],
        objective=bos_mass_objective(heads),
        progress=False,
        config=config(steps=40, lr=5e-2, eval_every=2, patience=2),
    )
    assert result.stopped_early and result.steps_done < 40
    best = result.history.set_index("step").loc[result.best_step, "heldout_ppl"]
    assert result.history["heldout_ppl"].min() == best
    from headsurgeon.evals import perplexity

    assert perplexity(model, tokens[16:24], window=16, prepend_bos=False) == pytest.approx(best)


def test_bad_input():
    model, heads, tokens = setup()
    with pytest.raises(DataError, match="fewer than one batch of 32"):
        finetune(model, heads, tokens, config=config(batch_size=32), progress=False)
    with pytest.raises(InvalidArgumentError, match="nothing to fine-tune"):
        finetune(model, HeadSet(), tokens, progress=False)
    with pytest.raises(InvalidArgumentError, match="patience"):
        finetune(model, heads, tokens, config=config(patience=2), progress=False)
    for bad in [
        dict(lr=0),
        dict(lr=float("nan")),
        dict(steps=0),
        dict(warmup_steps=6),
        dict(grad_accum=0),
        dict(strategy="all"),
        dict(autocast="float16"),
        dict(loss_chunk=0),
        dict(gradient_checkpointing="yes"),
    ]:
        with pytest.raises(InvalidArgumentError):
            config(**bad).validate()


DDP_RUN = """
import sys
import torch
import torch.distributed as dist
sys.path[:0] = {tests!r}
from test_finetune import config, setup
from headsurgeon.backend.weights import tl_state_dict
from headsurgeon.distributed import setup_distributed
from headsurgeon.finetune import finetune

torch.set_num_threads(1)
info = setup_distributed("cpu")
model, heads, tokens = setup()
finetune(model, heads, tokens, config=config(batch_size=2), progress=False)
if info.rank == 0:
    torch.save(tl_state_dict(model), {out!r})
dist.destroy_process_group()
"""


@pytest.mark.slow  # a subprocess
def test_ddp_two_processes_match_one_process_with_double_batch(tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(
        DDP_RUN.format(tests=[str(TESTS), str(TESTS.parent)], out=str(tmp_path / "ddp.pt"))
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ddp = torch.load(tmp_path / "ddp.pt")
    model, heads, tokens = setup()
    finetune(model, heads, tokens, config=config(batch_size=4), progress=False)
    for name, value in tl_state_dict(model).items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-4, atol=1e-5)
    assert not torch.equal(ddp["blocks.2.attn.W_O"], head_weight(setup()[0], 2, "W_O"))


def test_training_under_no_grad_enables_gradients_itself():
    """Issue 41: finetune (and repair, which trains through it) enable gradients themselves."""
    model, heads, tokens = setup("L2H0")
    before = snapshot(model)
    with torch.no_grad():
        result = finetune(model, heads, tokens, config=config(steps=2), progress=False)
    assert result.steps_done == 2
    trained = head_tensors(model, 2)["W_Q"]
    assert not torch.equal(trained.heads(trained.param), head_view(model, before, 2, "W_Q"))


def test_training_under_inference_mode_is_one_line():
    """Under torch.inference_mode() no gradient can be had: one line, the weights untouched."""
    model, heads, tokens = setup("L2H0")
    before = snapshot(model)
    with torch.inference_mode():
        with pytest.raises(InvalidArgumentError, match=r"torch.inference_mode\(\) forbids"):
            finetune(model, heads, tokens, config=config(steps=2), progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.named_parameters())
    with torch.inference_mode():
        made_there, heads, tokens = setup("L2H0")
    with pytest.raises(InvalidArgumentError, match="made under torch.inference_mode"):
        finetune(made_there, heads, tokens, config=config(steps=2), progress=False)
