"""The API names its argument: every public function that takes a model says so in one line when
given a name, a path, ``None``, a Hugging Face model or a model without weights (``meta``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import headsurgeon as hs
from headsurgeon.errors import InvalidArgumentError

# Each public model-taking function, with the least else it needs to reach its model check.
CALLS = {
    "run_census": lambda m: hs.run_census(m),
    "head_importance": lambda m: hs.head_importance(m),
    "ablate_heads": lambda m: hs.importance.ablate_heads(m, [(0, 0)]).__enter__(),
    "measure_blindness": lambda m: hs.measure_blindness(m),
    "mitigation": lambda m: hs.mitigation(m, "softcap").__enter__(),
    "perplexity": lambda m: hs.perplexity(m),
    "passkey": lambda m: hs.passkey(m),
    "needle": lambda m: hs.needle(m),
    "use_exact_alibi": lambda m: hs.loading.use_exact_alibi(m),
    "alibi_slopes": lambda m: hs.alibi_slopes(m),
    "install_exact_alibi": lambda m: hs.exact_alibi.install_exact_alibi(m),
    "model_info": lambda m: hs.model_info(m),
    "save_hf": lambda m: hs.save_hf(m, "/nonexistent/never-written"),
    "checkpoint_dtype": lambda m: hs.checkpoints.checkpoint_dtype(m),
    "reinit_heads": lambda m: hs.reinit_heads(m, [(0, 0)]),
    "mask_gradients": lambda m: hs.surgery.mask_gradients(m, [(0, 0)]),
    "repair": lambda m: __import__("headsurgeon.repair").repair.repair(m),
    "finetune": lambda m: __import__("headsurgeon.finetune").finetune.finetune(
        m, [(0, 0)], torch.zeros(2, 8, dtype=torch.long)
    ),
}


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize(
    "given, said",
    [
        ("organism", "is the name 'organism', not a model; load it first"),
        (Path("organism"), "is the name 'organism', not a model; load it first"),
        (None, "is None, not a model"),
        (torch.nn.Linear(2, 2), "is a Linear, not a TransformerLens"),
        (42, "is a int, not a model"),
    ],
    ids=["str", "Path", "None", "nn.Module", "int"],
)
def test_a_model_argument_that_is_not_a_model_is_one_line(name, given, said):
    with pytest.raises(InvalidArgumentError) as caught:
        CALLS[name](given)
    message = one_line(caught.value)
    assert message.startswith(f"{name}: model "), message
    assert said in message


def test_a_model_without_weights_is_one_line(bloom_dir):
    model = hs.load_model(bloom_dir)
    meta = model.to("meta")
    for name in ("run_census", "perplexity", "measure_blindness"):
        with pytest.raises(InvalidArgumentError, match="meta device"):
            CALLS[name](meta)


def _huge_integer_calls():
    """Library calls with a count of 10**30 or a seed of -1 (issue 51): each one line."""
    import headsurgeon as hs
    from headsurgeon.evals.retrieval import _passkey_task
    from headsurgeon.loading import ModelShape, random_model

    model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=16, d_vocab=32, n_ctx=32))
    tokens = torch.randint(0, 32, (2, 12))
    return {
        "n_seqs": lambda: hs.run_census(model, tokens, n_seqs=10**30, progress=False),
        "each of windows": lambda: hs.sink_cache_effect(model, tokens, windows=[10**30]),
        "each of distances": lambda: hs.window_effect(model, tokens, distances=[10**30]),
        "batch_size": lambda: hs.head_importance(model, tokens, batch_size=10**30),
        "context_length": lambda: hs.analytic_blindness(model, context_length=10**30),
        "n_digits": lambda: _passkey_task(10, 100, "some filler text"),
        "seed": lambda: random_model("bloom-560m", seed=-1),
    }


def test_huge_integers_and_negative_seeds_are_one_line():
    for name, call in _huge_integer_calls().items():
        with pytest.raises(InvalidArgumentError, match=f"^{name} must be an integer") as e:
            call()
        assert "\n" not in str(e.value), name
