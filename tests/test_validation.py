"""Values of the wrong type or range: one headsurgeon error at the public boundary, never a raw
exception, never a silent cast; a head with non-finite metrics is never healthy."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from conftest import error_line

from headsurgeon import plots
from headsurgeon.census import run_census
from headsurgeon.checkpoint_diff import weight_changes
from headsurgeon.classify import Thresholds, classify_heads
from headsurgeon.cli import blindness as blindness_cli, classify as classify_cli
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.surgery import HeadSet
from headsurgeon.validation import check_bool, check_choice, check_int, check_number


@pytest.mark.parametrize(
    ("value", "kwargs", "expected"),
    [
        (3, {"minimum": 1}, 3),
        (np.int64(4), {}, 4),
        (torch.tensor(5), {"maximum": 5}, 5),
        (0, {"minimum": 0}, 0),
    ],
)
def test_check_int_accepts_integers_of_any_library(value, kwargs, expected):
    result = check_int(value, "n", **kwargs)
    assert result == expected and type(result) is int


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [
        (True, {}),
        (2.0, {}),
        ("2", {}),
        (None, {}),
        (0, {"minimum": 1}),
        (6, {"maximum": 5}),
        (np.bool_(True), {}),
        (torch.tensor(1.0), {}),
    ],
)
def test_check_int_refuses_what_is_not_an_integer_in_range(value, kwargs):
    with pytest.raises(InvalidArgumentError, match=r"^n must be an integer.*, got "):
        check_int(value, "n", **kwargs)


def test_check_number_bounds_open_and_closed_and_non_finite():
    assert check_number(np.float32(0.5), "x", low=0, high=1) == 0.5
    assert check_number(1, "x", low=0, high=1) == 1.0
    assert check_number(math.inf, "x", low=0, finite=False) == math.inf
    refused = [
        (0.0, {"low": 0, "low_open": True}),
        (1.0, {"high": 1, "high_open": True}),
        (math.nan, {"finite": False}),
        (math.inf, {}),
        ("0.5", {}),
        (False, {}),
    ]
    for value, kwargs in refused:
        with pytest.raises(InvalidArgumentError, match="^x must be"):
            check_number(value, "x", **kwargs)


def test_check_choice_and_check_bool():
    assert check_choice("hf", "convention", ("hf", "tl")) == "hf"
    with pytest.raises(InvalidArgumentError, match="unknown convention 'HF'; use one of hf, tl"):
        check_choice("HF", "convention", ("hf", "tl"))
    assert check_bool(np.bool_(False), "flag") is False
    with pytest.raises(InvalidArgumentError, match="flag must be True or False, got 1"):
        check_bool(1, "flag")


@pytest.mark.parametrize(
    ("heads", "message"),
    [
        ([(1.5, 2)], "must be an integer"),
        (["L1H2"], "HeadSet.of"),
        ("L1H2", "HeadSet.of"),
        ([(0, 1, 2)], "cannot read head"),
        ([(0, -1)], ">= 0"),
        (7, "takes \\(layer, head\\) pairs"),
    ],
)
def test_headset_never_truncates_or_raises_raw(heads, message):
    with pytest.raises(InvalidArgumentError, match=message):
        HeadSet(heads)


def test_headset_takes_numpy_and_tensor_rows():
    assert str(HeadSet(np.array([[0, 1], [2, 3]]))) == "L0H1,L2H3"
    assert str(HeadSet(torch.tensor([[1, 0]]))) == "L1H0"


def test_classification_never_calls_a_non_finite_head_healthy(caplog):
    census = pd.DataFrame(
        {
            "layer": [0, 0, 0, 0],
            "head": [0, 1, 2, 3],
            "bos_mass": [np.nan, 0.1, np.inf, 0.1],
            "output_share": [0.3, np.nan, 0.3, 0.3],
        }
    )
    df = classify_heads(census)
    assert df["label"].tolist() == ["dead", "dead", "dead", "healthy"]
    assert df["reason"][0].startswith("metrics not finite")
    assert "3 head(s) have non-finite metrics (L0H0, L0H1, L0H2)" in caplog.text


def test_classification_refuses_text_columns():
    census = pd.DataFrame({"layer": [0], "head": [0], "bos_mass": ["0.1"], "output_share": [0.3]})
    with pytest.raises(InvalidArgumentError, match="bos_mass holds .* values, not numbers"):
        classify_heads(census)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (torch.rand(2, 16), "integer token ids, got dtype torch.float32"),
        (torch.ones(2, 16, dtype=torch.bool), "integer token ids"),
        (torch.zeros(16, dtype=torch.long), r"\[n_seqs, seq_len\]"),
        (torch.full((2, 16), 10_000), "token ids must lie in 0.."),
    ],
)
def test_census_refuses_tokens_that_are_not_token_ids(tiny_model, tokens, message):
    with pytest.raises(DataError, match=message):
        run_census(tiny_model, tokens, progress=False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_query_pos": "1"},
        {"steps": 10.0},
        {"lr": math.nan},
        {"betas": (0.9,)},
        {"strategy": "all"},
        {"restore_best": "yes"},
        {"warmup_steps": 200},
        {"max_grad_norm": 0},
    ],
)
def test_finetune_config_is_checked_on_creation(kwargs):
    with pytest.raises(InvalidArgumentError):
        FinetuneConfig(**kwargs)


def test_weight_changes_takes_heads_in_any_form():
    qkv = "transformer.h.0.self_attention.query_key_value.weight"
    before = {qkv: torch.zeros(12, 4)}
    after = {qkv: before[qkv].clone()}
    after[qkv][2, 0] = 1.0  # head 0's key: with d_head 2, head 0 owns rows 0-5 (q, k, v)
    for heads in ("L0H0", [(0, 0)], {0: [0]}, HeadSet([(0, 0)])):
        assert weight_changes(before, after, heads, d_head=2)["head_changed"].sum() == 1
    with pytest.raises(InvalidArgumentError, match="cannot read head"):
        weight_changes(before, after, "L0Hx", d_head=2)


def test_save_figure_refuses_what_is_not_a_figure(tmp_path):
    with pytest.raises(InvalidArgumentError, match="takes a plotly Figure"):
        plots.save_figure(None, tmp_path / "x.html")
    assert not any(tmp_path.iterdir())


def test_thresholds_store_plain_floats():
    t = Thresholds(sink=np.float64(0.4), dead=1)
    assert type(t.sink) is float and type(t.dead) is float


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (classify_cli.main, ["--top", "-1"], "argument --top: expected an integer >= 0, got '-1'"),
        (classify_cli.main, ["--n-seqs", "0"], "argument --n-seqs: expected a positive integer"),
        (
            blindness_cli.main,
            ["--robust-context", "0"],
            "argument --robust-context: expected a pos",
        ),
        (blindness_cli.main, ["--dtype", "float16"], "unrecognized arguments: --dtype"),
        (blindness_cli.main, ["--max-distance", "-5"], "argument --max-distance: expected a pos"),
    ],
)
def test_cli_values_out_of_range_are_one_line_before_any_work(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert "--help lists the options" in err


def test_robust_context_defaults_to_the_max_distance_not_through_or(tmp_path, capsys):
    out = tmp_path / "b"
    blindness_cli.main(
        [
            "bloom-560m",
            "--mitigation",
            "robust",
            "--max-distance",
            "512",
            "--dtypes",
            "float32",
            "--limit",
            "normal",
            "--out",
            str(out),
        ]
    )
    table = pd.read_csv(out / "blindness.csv")
    # Robust slopes for a 512-token context keep every head sighted within it.
    assert (table["label"] == "sighted").all()


@pytest.mark.parametrize("data", [5, [1, 2, 3], [b"bytes"], {"text": 1}])
def test_data_of_the_wrong_type_is_one_line(tiny_model, data):
    with pytest.raises(DataError, match="data must be texts, text files or a token tensor"):
        run_census(tiny_model, data, progress=False)


def test_reinit_refuses_a_seed_that_is_not_an_integer(tiny_model):
    from headsurgeon.surgery import reinit_heads

    before = tiny_model.blocks[0].attn.W_Q.detach().clone()
    with pytest.raises(InvalidArgumentError, match="seed must be an integer"):
        reinit_heads(tiny_model, "L0H0", seed="1")
    assert torch.equal(tiny_model.blocks[0].attn.W_Q, before)


def test_save_figure_refuses_a_path_that_is_not_a_path():
    with pytest.raises(InvalidArgumentError, match="needs a file path, got int"):
        plots.save_figure(go.Figure(), 5)


def test_finetune_refuses_float_tokens_rather_than_casting_them(tiny_model):
    from headsurgeon.finetune import finetune

    with pytest.raises(DataError, match="training data: a token tensor holds integer token ids"):
        finetune(
            tiny_model, "L0H0", torch.rand(8, 16), config=FinetuneConfig(steps=2), progress=False
        )


def test_a_huge_integer_is_one_short_line():
    """Python refuses to print an int of over 4,300 digits: the message gives its size instead."""
    for check in (
        lambda v: check_int(v, "steps", maximum=10),
        lambda v: check_number(v, "lr", high=1),
    ):
        with pytest.raises(InvalidArgumentError, match="got an integer of about 5001 digits$"):
            check(10**5000)


# Issue 41: integer options in range before use, each message naming the option.


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "99999999999999999999"], "argument --threads: expected a positive thread"),
        (["--threads", "100000"], "argument --threads: expected a positive thread count of at"),
        (["--threads", "²"], "argument --threads: expected a positive thread count, got '²'"),
        (["--n-seqs", "9" * 5000], "argument --n-seqs: expected a positive integer of at most"),
        (["--top", "-" + "9" * 40], "argument --top: expected an integer >= 0, got '-9999"),
    ],
)
def test_huge_integer_options_are_one_line(argv, message, capsys, no_model):
    line = error_line(classify_cli.main, ["organism", *argv], capsys)
    assert message in line and "Traceback" not in line and len(line) < 300


def test_seeds_are_64_bit(capsys, no_model):
    from headsurgeon.cli import repair as repair_cli
    from headsurgeon.repair import RepairConfig

    line = error_line(repair_cli.main, ["organism", "--seed", 2**70], capsys)
    assert "argument --seed: expected a seed >= 0 of at most 9223372036854775807" in line
    for make in (FinetuneConfig, RepairConfig):
        with pytest.raises(InvalidArgumentError, match="seed must be an integer"):
            make(seed=2**63)
    # The largest seed trains: the epoch seed is reduced into torch's range.
    from headsurgeon.finetune import finetune
    from headsurgeon.loading import ModelShape, random_model

    model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=16, n_ctx=8))
    tokens = torch.randint(0, 16, (4, 8))
    config = FinetuneConfig(steps=1, batch_size=2, seed=2**63 - 1)
    assert finetune(model, "L0H0", tokens, config=config, progress=False).steps_done == 1


def test_a_batch_larger_than_memory_is_refused_before_it_runs(monkeypatch):
    """--batch-size 100000 grew to 18.6 GB and was killed: now one line, before any forward."""
    from headsurgeon import probes
    from headsurgeon.loading import ModelShape, random_model

    model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=16, n_ctx=64))
    tokens = torch.zeros(64, 32, dtype=torch.long)
    monkeypatch.setattr(probes, "_free_memory", lambda device: 1 << 20)
    fired = []
    hook = ("blocks.0.hook_resid_pre", lambda x, hook: fired.append(1))
    with pytest.raises(InvalidArgumentError, match=r"more than the 0\.0 GiB free; use a smaller"):
        probes.stream(model, tokens, [hook], batch_size=64, progress=False)
    assert not fired
    probes.stream(model, tokens, [hook], batch_size=4, progress=False)
    assert fired
