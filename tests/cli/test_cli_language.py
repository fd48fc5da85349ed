"""The tools speak their own language (issue 51, classes 8-10): refusals name the options the
command line has, every option a message or a help text names exists in that tool, options
that need --dataset refuse to stand alone, a value given twice (through an alias too) is one
line, held-out text that is the training text is refused unless allowed, huge integers are one
line before any model is loaded, and a tool's main() gives its host process back what it
changed."""

from __future__ import annotations

import ast
import logging
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import TEXT, error_line

import headsurgeon
from headsurgeon import allocator
from headsurgeon.cli import blindness, classify, repair

TOOLS = {"classify": classify, "blindness": blindness, "repair": repair}
CLI = Path(headsurgeon.__file__).parent / "cli"


def _options(tool) -> set[str]:
    return {o for a in tool._parser()._actions for o in a.option_strings}


def _snake_case(line: str) -> list[str]:
    """Identifiers with an underscore: the library's parameter names, which no option has
    (paths quoted in the line are left out)."""
    return re.findall(r"(?<![\w/.'-])[a-z]+(?:_[a-z]+)+(?![\w/.'])", line)


# (tool, arguments, what the line must say): refusals that come from the library's checks.
REFUSALS = [
    ("repair", ["--sink-threshold", "2"], "--sink-threshold must be"),
    ("repair", ["--dead-threshold", "0.1"], "--sink-threshold 0.5 must be below --dead-threshold"),
    ("repair", ["--min-output-share", "5"], "--min-output-share must be"),
    ("repair", ["--lr", "nan"], "--lr must be"),
    ("repair", ["--max-grad-norm", "-1"], "--max-grad-norm must be"),
    ("repair", ["--weight-decay", "-1"], "--weight-decay must be"),
    ("repair", ["--train-seq-len", "1"], "--train-seq-len must be"),
    ("repair", ["--warmup", "500", "--steps", "10"], "--warmup must be"),
    ("repair", ["--max-ppl-increase", "-1"], "--max-ppl-increase must be"),
    ("repair", ["--drift-threshold", "2"], "--drift-threshold must be"),
    ("classify", ["--sink-threshold", "-1"], "--sink-threshold must be"),
    ("blindness", ["--sink-cache", "--sink-seq-len", "2"], "--sink-seq-len must be"),
    ("blindness", ["--sink-cache", "--sink-head-seq-len", "1"], "--sink-head-seq-len must be"),
    (
        "blindness",
        ["--sink-cache", "--sinks", "4", "--windows", "100", "--sink-head-seq-len", "50"],
        "give --sink-head-seq-len and --sink-seq-len above 105",
    ),
    (
        "blindness",
        ["--sink-cache", "--sinks", "2", "--windows", "70", "--sink-seq-len", "64"],
        "or smaller --sinks or --windows",
    ),
]


@pytest.mark.parametrize(("tool", "argv", "said"), REFUSALS)
def test_refusals_name_the_options_not_the_librarys_parameters(
    tool, argv, said, no_model, capsys, tmp_path
):
    argv = ["organism-injured", *argv, "--out", tmp_path / "out"]
    line = error_line(TOOLS[tool].main, argv, capsys)
    assert said in line, line
    assert not _snake_case(line), line
    assert "heads=[]" not in line and "head_cache" not in line


def test_the_option_table_rewrites_words_not_parts_of_words():
    from headsurgeon.cli.session import _in_option_terms, option_names

    names = option_names(repair._parser())
    line = "min_query_pos=3; a smaller seq_len (--seq-len); passes must be >= 1; the passes"
    assert _in_option_terms(line, names) == (
        "--min-query-pos=3; a smaller seq_len (--seq-len); --passes must be >= 1; the passes"
    )


def _message_options(path: Path) -> set[str]:
    """Every ``--option`` in the strings of a module's calls (errors, warnings, parser.error)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            for part in ast.walk(node):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    found |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", part.value))
    return found


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_every_option_a_tool_names_is_one_it_has(name):
    """Each tool's messages (its two modules) and its --help name only its own options; the
    library's and the shared modules' messages only options some tool has."""
    options = _options(TOOLS[name]) | {"--help"}
    named = _message_options(CLI / f"{name}.py") | _message_options(CLI / f"{name}_run.py")
    for action in TOOLS[name]._parser()._actions:
        named |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", action.help or ""))
    assert named - options == set()


def test_the_library_names_only_options_some_tool_has():
    every = set().union(*map(_options, TOOLS.values())) | {"--help"}
    # Other programs' options the messages quote as such.
    foreign = {"--nproc-per-node", "--upgrade", "--user", "--index-url", "--extra-index-url"}
    root = Path(headsurgeon.__file__).parent
    named = {}
    for path in root.rglob("*.py"):
        if path.parent != CLI or path.name in ("__init__.py", "loads.py"):
            for option in _message_options(path) - every - foreign:
                named.setdefault(option, []).append(str(path.relative_to(root)))
    assert named == {}


@pytest.mark.parametrize("name", ["classify", "blindness", "repair"])
@pytest.mark.parametrize("given", [["--split", "test"], ["--column", "body"]])
def test_split_and_column_need_the_dataset(name, given, no_model, capsys, tmp_path):
    line = error_line(TOOLS[name].main, ["organism", *given, "--out", tmp_path / "o"], capsys)
    assert f"{given[0]} applies to --dataset; give --dataset too" in line


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--dtypes", "float16", "fp16", "half"], "--dtypes names float16 more than once"),
        (["--dtypes", "bf16", "BFLOAT16"], "--dtypes names bfloat16 more than once"),
        (["--limit", "zero", "zero"], "--limit names zero more than once"),
        (["--sink-cache", "--sinks", "1", "1"], "--sinks names 1 more than once"),
        (["--dtypes", "float8"], "unknown dtype 'float8'"),
    ],
)
def test_a_value_given_twice_is_one_line(argv, said, no_model, capsys, tmp_path):
    line = error_line(blindness.main, ["organism", *argv, "--out", tmp_path / "o"], capsys)
    assert said in line, line


def test_classify_runs_a_model_named_twice_once_refused(no_model, capsys, tmp_path):
    argv = ["organism", "organism", "--out", tmp_path / "o"]
    assert "MODEL names organism more than once" in error_line(classify.main, argv, capsys)


@pytest.fixture
def dataset_dir(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    for split in ("train", "validation"):
        (folder / f"{split}.jsonl").write_text('{"text": "a b c"}\n')
    return folder


@pytest.mark.parametrize(
    "given",
    [
        ["--eval-split", "train"],
        ["--eval-split", "train "],
        ["--split", "validation", "--eval-split", "validation"],
    ],
)
def test_held_out_split_that_is_the_training_split_is_refused(
    given, dataset_dir, no_model, capsys, tmp_path
):
    argv = ["organism-injured", "--dataset", dataset_dir, *given, "--out", tmp_path / "o"]
    line = error_line(repair.main, argv, capsys)
    assert "is the training split" in line and "--allow-eval-on-train" in line


def test_held_out_files_that_are_the_training_files_are_refused(no_model, capsys, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    (tmp_path / "link.txt").symlink_to(text)
    for held_out in (text, tmp_path / "link.txt"):
        argv = ["organism-injured", "--corpus", text, "--eval-corpus", held_out]
        line = error_line(repair.main, [*argv, "--out", tmp_path / "o"], capsys)
        assert "is the --corpus file" in line and "--allow-eval-on-train" in line


def test_the_repairs_dataset_is_its_training_text_not_texts(injured, capsys, tmp_path):
    """A text file given as --dataset: the repair's training text files go to --corpus."""
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    line = error_line(repair.main, [injured, "--dataset", text, "--out", tmp_path / "o"], capsys)
    assert "text files go to --corpus" in line and "--texts" not in line, line


def test_blindness_measures_no_single_token_sequences(no_model, capsys, tmp_path):
    argv = ["organism", "--measure", "--seq-len", "1", "--out", tmp_path / "o"]
    line = error_line(blindness.main, argv, capsys)
    assert "--measure needs --seq-len 2 or more" in line and "--min-query-pos" not in line


def test_a_copy_of_the_training_text_is_refused_once_cut(injured, capsys, tmp_path):
    """Another name, the same text: the held-out sequences are training sequences."""
    text, copy = tmp_path / "a.txt", tmp_path / "b.txt"
    text.write_text(TEXT)
    copy.write_text(TEXT)
    argv = [injured, "--corpus", text, "--eval-corpus", copy, "--train-seq-len", "32"]
    line = error_line(repair.main, [*argv, "--out", tmp_path / "o"], capsys)
    assert "held-out sequences are training sequences" in line, line
    assert "--eval-corpus (or --eval-split)" in line and "--allow-eval-on-train" in line
    assert not (tmp_path / "o").exists()


def test_the_library_refuses_or_states_judging_on_the_training_text(injured):
    from headsurgeon import load_model
    from headsurgeon.errors import InvalidArgumentError
    from headsurgeon.repair import repair as repair_heads

    model = load_model(injured)
    with pytest.raises(InvalidArgumentError, match="eval_on_train=True to judge on it anyway"):
        repair_heads(model, TEXT, eval_corpus=TEXT, eval_on_train=False, train_seq_len=32)


# Integer options and the values a hostile user gives them.
HUGE = [str(2**63 - 1), str(10**30), "-1", "99999999"]


def _int_options(tool) -> list[str]:
    from headsurgeon.cli import options

    types = (options.positive_int, options.non_negative_int, options.seed, options.thread_count)
    return [a.option_strings[-1] for a in tool._parser()._actions if a.type in types]


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_every_integer_option_refuses_huge_values_in_one_line(name, capsys):
    options = _int_options(TOOLS[name])
    assert len(options) >= 5
    for option in options:
        for value in HUGE:
            parser = TOOLS[name]._parser()
            if option == "--seed" and value in (str(2**63 - 1), "99999999"):
                assert parser.parse_args(["organism", option, value]).seed == int(value)
                continue
            with pytest.raises(SystemExit) as exit_info:
                parser.parse_args(["organism", option, value])
            assert exit_info.value.code == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and option in err, (option, value, err)


def _host_state():
    loggers = [logging.getLogger(), logging.getLogger("headsurgeon")]
    return {
        "signals": [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
        "threads": torch.get_num_threads(),
        "logging": [(x.level, list(x.handlers), x.propagate) for x in loggers],
        "allocator": allocator.allocator_setting(),
    }


def test_main_gives_its_host_back_signals_threads_logging_and_allocator(
    bloom_dir, tmp_path, no_browser
):
    """A program calling main() (a quick run, a refused one, a usage error) finds its process
    as it was."""
    before = _host_state()
    argv = [bloom_dir, "--n-seqs", "2", "--seq-len", "16", "--no-secondary-sinks", "--threads"]
    argv += [before["threads"] + 1]
    assert classify.main([str(a) for a in [*argv, "--out", tmp_path / "a"]]) == 0
    assert _host_state() == before
    with pytest.raises(headsurgeon.errors.InvalidArgumentError):
        classify.main([str(a) for a in [*argv, "--sink-threshold", "2", "--out", tmp_path / "b"]])
    assert _host_state() == before
    with pytest.raises(SystemExit):
        classify.main(["--n-seqs", "0"])
    assert _host_state() == before


def test_a_tool_session_puts_back_what_the_run_changed():
    """What a run may change (a --max-memory load fixes the allocator's thresholds; a library
    sets its loggers), put back when it ends, by a return or an error."""
    from headsurgeon.cli import work_begins
    from headsurgeon.cli.session import tool_session

    before = _host_state()
    with pytest.raises(RuntimeError), tool_session(repair._parser()):
        work_begins()
        torch.set_num_threads(before["threads"] + 2)
        allocator.return_freed_memory() if before["allocator"] else allocator.keep_freed_memory()
        logging.getLogger().addHandler(logging.NullHandler())
        logging.getLogger("headsurgeon").setLevel(logging.DEBUG)
        assert _host_state() != before
        raise RuntimeError
    assert _host_state() == before
