"""Ownership of outputs (issue 23): a tool replaces or removes only what it provably wrote.

Every output folder carries ``.headsurgeon-output.json`` (the mark); ``--overwrite`` replaces only
an empty folder or one whose mark lists everything in it; an output never is, holds or lies
inside an input; ``/``, home, the working directory, symlink loops and dangling links are one
line before any work; leftovers (``.NAME.tmp-*``, ``.NAME.old-*``, ``.NAME.lock``,
``NAME.partial``) are removed only when they are provably the tool's. Each case proves that the
user's files survive, byte for byte, and that nothing hidden is left beside the output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEXT, error_line

import headsurgeon.cli
import headsurgeon.cli.blindness
import headsurgeon.cli.classify
import headsurgeon.cli.repair
from headsurgeon import load_model, save_hf
from headsurgeon.cli.options import run_inputs
from headsurgeon.cli.repair_run import WORK_WRITER
from headsurgeon.errors import OutputExistsError
from headsurgeon.outputs import (
    MARK_FILE,
    atomic_directory,
    atomic_write_text,
    check_output_dir,
    claim_output,
    foreign_files,
    mark_folder,
    read_mark,
    resolve_output,
)

CLASSIFY = headsurgeon.cli.classify.main
REPAIR = headsurgeon.cli.repair.main
BLINDNESS = headsurgeon.cli.blindness.main
FAST = ["--seq-len", "16", "--n-seqs", "2", "--threads", "1"]


# --- helpers -------------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, object]:
    """Every entry under ``folder`` (symlinks not followed): a file's bytes, a link's target, a
    folder as ``"<dir>"``, a FIFO as ``"<special>"``. Equal snapshots: nothing was added, removed
    or changed."""
    found: dict[str, object] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            key = str(path.relative_to(folder))
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_dir():
                found[key] = "<dir>"
            elif not path.is_file():  # a FIFO: reading it would block
                found[key] = "<special>"
            else:
                found[key] = path.read_bytes()
    return found


def hidden_beside(path: Path) -> list[str]:
    """Hidden leftovers of ``path`` beside it (temporaries, old copies, the lock)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def documents(folder: Path) -> Path:
    """A user's folder: documents, dot-files, a git work tree."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "thesis.tex").write_text("chapter 1")
    (folder / ".bashrc").write_text("alias ll='ls -l'")
    (folder / ".git" / "objects").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "notes").mkdir()
    (folder / "notes" / "todo.txt").write_text("write more")
    return folder


def marked_output(folder: Path, writer: str = "write_classification", **files: str) -> Path:
    """An output as headsurgeon leaves one: written through atomic_directory, so marked."""
    with atomic_directory(folder, writer=writer) as tmp:
        for name, text in (files or {"heads.csv": "layer,head\n"}).items():
            atomic_write_text(tmp / name, text)
    return folder


@pytest.fixture()
def scratch(tmp_path, monkeypatch) -> Path:
    """A scratch working directory and home folder, both under ``tmp_path``."""
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return tmp_path


@pytest.fixture()
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus" / "text.txt"
    path.parent.mkdir()
    path.write_text(TEXT)
    return path


# --- 1. the mark -------------------------------------------------------------------------------


def test_an_output_is_marked_with_every_file_it_holds(tmp_path):
    out = tmp_path / "out"
    with atomic_directory(out, writer="write_report") as tmp:
        mark = read_mark(tmp)
        assert mark is not None and mark.files == ()  # from the start: a killed run's is ours
        atomic_write_text(tmp / "report.md", "# report")
        (tmp / "empty").mkdir()
        with atomic_directory(tmp / "model", writer="save_hf") as inner:
            atomic_write_text(inner / "config.json", "{}")
    mark = read_mark(out)
    assert mark.writer == "write_report" and mark.version and mark.created
    assert mark.files == (
        "empty/",
        "model/.headsurgeon-output.json",
        "model/config.json",
        "report.md",
    )
    assert read_mark(out / "model").files == ("config.json",)
    document = json.loads((out / MARK_FILE).read_text())
    assert document["written_by"] == "headsurgeon" and document["files"] == list(mark.files)
    assert foreign_files(out) == [] and hidden_beside(out) == []


MARK = {"written_by": "headsurgeon", "writer": "x", "version": "1", "created": "", "files": []}


@pytest.mark.parametrize(
    "mark",
    [
        "not json",
        json.dumps(MARK | {"written_by": "someone else"}),
        json.dumps(MARK | {"files": ["../outside.txt"]}),
        json.dumps(MARK | {"files": "data.txt"}),
        "symlink",
    ],
)
def test_a_mark_that_is_not_valid_makes_the_folder_foreign(tmp_path, mark):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "data.txt").write_text("mine")
    if mark == "symlink":
        real = marked_output(tmp_path / "real")
        (folder / MARK_FILE).symlink_to(real / MARK_FILE)
    else:
        (folder / MARK_FILE).write_text(mark)
    assert read_mark(folder) is None
    assert "data.txt" in foreign_files(folder)
    before = snapshot(folder)
    with pytest.raises(OutputExistsError, match="did not write"):
        check_output_dir(folder, overwrite=True)
    assert snapshot(folder) == before


def test_mark_folder_lists_what_is_there_or_what_it_is_told(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    mark_folder(tmp_path, "test")
    assert read_mark(tmp_path).files == ("a.txt", "sub/b.txt")
    mark_folder(tmp_path, "test", files=["a.txt"])
    assert foreign_files(tmp_path) == ["sub"]  # a folder the mark never names: one entry


# --- 2. --overwrite replaces only what headsurgeon wrote ------------------------------------------


def test_overwrite_replaces_a_marked_output(tmp_path):
    out = marked_output(tmp_path / "out", **{"heads.csv": "old"})
    with atomic_directory(out, overwrite=True) as tmp:
        atomic_write_text(tmp / "heads.csv", "new")
    assert (out / "heads.csv").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_documents_is_refused_naming_what_is_in_it(tmp_path, overwrite):
    folder = documents(tmp_path / "somefolder")
    before = snapshot(folder)
    with pytest.raises(OutputExistsError) as error:
        with claim_output(folder, overwrite=overwrite), atomic_directory(folder, overwrite):
            pytest.fail("the body must not run")
    line = str(error.value)
    assert "\n" not in line and str(folder) in line
    assert "did not write: .bashrc, .git, notes, … (4 in all); choose another folder" in line
    assert snapshot(folder) == before and hidden_beside(folder) == []


def test_a_file_added_to_an_output_after_the_run_blocks_overwrite(tmp_path):
    out = marked_output(tmp_path / "out")
    (out / "my-notes.txt").write_text("keep me")
    before = snapshot(out)
    with pytest.raises(OutputExistsError, match=r"did not write: my-notes.txt; choose another"):
        check_output_dir(out, overwrite=True)
    assert snapshot(out) == before


def test_a_file_added_during_the_run_keeps_the_old_folder(tmp_path):
    out = marked_output(tmp_path / "out")
    with pytest.raises(OutputExistsError, match="it was kept as it was"):
        with atomic_directory(out, overwrite=True) as tmp:
            atomic_write_text(tmp / "heads.csv", "new")
            (out / "added-meanwhile.txt").write_text("keep me")
    assert (out / "added-meanwhile.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_empty_folder_is_written_into(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with atomic_directory(out, overwrite=True) as tmp:
        atomic_write_text(tmp / "a.txt", "a")
    assert read_mark(out).files == ("a.txt",) and sorted(os.listdir(tmp_path)) == ["out"]


# --- 3. outputs never touch inputs ---------------------------------------------------------------


def test_an_output_is_never_an_input_holds_one_or_lies_inside_one(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    corpus = tmp_path / "data" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text("text")
    before = snapshot(tmp_path)
    cases = {
        model: "is the input",
        model / "sub": "is inside the input",
        corpus.parent: "holds the input",
        tmp_path: "holds the input",
    }
    for out, relation in cases.items():
        for overwrite in (False, True):
            with pytest.raises(OutputExistsError, match=relation):
                check_output_dir(out, overwrite, inputs=[model, corpus])
    assert snapshot(tmp_path) == before
    # Beside the inputs (and beside the text file, in its folder) is fine.
    assert check_output_dir(tmp_path / "out", inputs=[model, corpus]) == tmp_path / "out"
    assert check_output_dir(corpus.parent / "out", inputs=[model, corpus])


def test_run_inputs_are_the_model_folder_and_the_text_files(bloom_dir, text_file):
    args = headsurgeon.cli.repair._parser().parse_args(
        [str(bloom_dir), "--texts", str(text_file), "--corpus", str(text_file)]
    )
    assert run_inputs(args) == [bloom_dir, text_file, text_file]
    from headsurgeon.model_names import ORGANISM_DIR

    args = headsurgeon.cli.repair._parser().parse_args(["organism-injured"])
    assert run_inputs(args) == [ORGANISM_DIR / "organism-injured"]


@pytest.mark.parametrize("tool", ["classify", "repair", "blindness"])
def test_out_equal_to_the_model_folder_is_refused_before_loading(
    tool, bloom_dir, tmp_path, no_model, capsys
):
    model = tmp_path / "model"
    shutil.copytree(bloom_dir, model)
    (model / "truth.json").write_text('{"dead": ["L0H1"]}')
    before = snapshot(tmp_path)
    main = {"classify": CLASSIFY, "repair": REPAIR, "blindness": BLINDNESS}[tool]
    for out in (model, model / "report"):
        line = error_line(main, [model, "--out", out, "--overwrite"], capsys)
        assert f"the input {model}" in line and "choose a folder outside them" in line
    assert snapshot(tmp_path) == before


def test_out_holding_the_texts_is_refused_before_loading(
    bloom_dir, text_file, tmp_path, no_model, capsys
):
    before = snapshot(tmp_path)
    for argv in (
        [bloom_dir, "--texts", text_file],
        [bloom_dir, "--corpus", text_file, "--heads", "L0H0"],
        [bloom_dir, "--eval-corpus", text_file, "--heads", "L0H0"],
    ):
        main = CLASSIFY if argv[1] == "--texts" else REPAIR
        line = error_line(main, [*argv, "--out", text_file.parent, "--overwrite"], capsys)
        assert f"holds the input {text_file}" in line
    assert snapshot(tmp_path) == before


def test_save_hf_never_writes_over_the_folder_it_loaded_from(bloom_dir, tmp_path):
    source = tmp_path / "models" / "mine"
    shutil.copytree(bloom_dir, source)
    (source / "truth.json").write_text('{"dead": []}')
    model = load_model(source)
    before = snapshot(tmp_path)
    for out, relation in [
        (source, "is the input"),
        (source.parent, "holds the input"),
        (source / "export", "is inside the input"),
    ]:
        with pytest.raises(OutputExistsError, match=relation):
            save_hf(model, out, overwrite=True)
    assert snapshot(tmp_path) == before
    # Its own earlier export it may replace; a folder it did not write it may not.
    export = save_hf(model, tmp_path / "export", verify=False)
    assert read_mark(export).writer == "save_hf" and foreign_files(export) == []
    save_hf(model, export, overwrite=True, verify=False)
    (export / "truth.json").write_text("mine")
    with pytest.raises(OutputExistsError, match="did not write: truth.json"):
        save_hf(model, export, overwrite=True, verify=False)
    assert (export / "truth.json").read_text() == "mine"
    assert hidden_beside(export) == []


# --- 4. paths the output code cannot name --------------------------------------------------------


def test_root_home_working_directory_and_parents_are_refused_even_with_overwrite(scratch):
    home, work = scratch / "home", scratch / "work"
    (work / "deep").mkdir()
    os.chdir(work / "deep")
    before = snapshot(scratch)
    cases = {
        "/": "is the root folder",
        str(home): "is the home folder",
        ".": "is the working directory",
        "": "is the working directory",
        "..": "is a parent of the working directory",
        str(scratch): "is a parent of the",
    }
    for given, what in cases.items():
        for overwrite in (False, True):
            with pytest.raises(OutputExistsError, match=what) as error:
                check_output_dir(given, overwrite)
            assert "\n" not in str(error.value)
            assert "never writes into or replaces" in str(error.value)
    assert snapshot(scratch) == before


def test_dot_and_home_on_the_command_line_are_one_line(scratch, bloom_dir, no_model, capsys):
    before = snapshot(scratch)
    line = error_line(CLASSIFY, [bloom_dir, "--out", "."], capsys)  # an empty working directory
    assert line == (
        f"error: output folder . ({scratch / 'work'}) is the working directory, which "
        "headsurgeon never writes into or replaces; choose a new folder for the output, e.g. one "
        "inside it"
    )
    line = error_line(CLASSIFY, [bloom_dir, "--out", scratch / "home", "--overwrite"], capsys)
    assert "is the home folder" in line
    line = error_line(REPAIR, [bloom_dir, "--out", "..", "--overwrite"], capsys)
    assert "is a parent of the" in line  # of the home folder and of the working directory
    assert snapshot(scratch) == before


def test_a_relative_out_is_resolved(scratch):
    assert resolve_output("results") == scratch / "work" / "results"
    assert resolve_output("../work/./results") == scratch / "work" / "results"


@pytest.mark.parametrize("kind", ["dangling", "loop", "loop above"])
def test_broken_symlinks_are_one_line_before_loading(kind, bloom_dir, tmp_path, no_model, capsys):
    link = tmp_path / "link"
    if kind == "dangling":
        link.symlink_to(tmp_path / "nowhere")
        out, message = link, f"is a symlink to {tmp_path / 'nowhere'}, which does not exist"
    else:
        link.symlink_to(tmp_path / "other")
        (tmp_path / "other").symlink_to(link)
        out = link if kind == "loop" else link / "out"
        message = "is a symlink loop" if kind == "loop" else "cannot resolve output path"
    before = snapshot(tmp_path)
    for main in (CLASSIFY, REPAIR, BLINDNESS):
        line = error_line(main, [bloom_dir, "--out", out, "--overwrite"], capsys)
        assert message in line and "another run" not in line
    assert snapshot(tmp_path) == before


def test_a_symlinked_out_writes_its_target_and_leaves_no_old_link(bloom_dir, text_file, tmp_path):
    target = marked_output(tmp_path / "results" / "run1")
    link = tmp_path / "latest"
    link.symlink_to(target)
    argv = [str(bloom_dir), "--texts", str(text_file), *FAST, "--out", str(link), "--overwrite"]
    assert CLASSIFY(argv) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert read_mark(target).writer == "write_classification" and foreign_files(target) == []
    assert (target / "heads.csv").read_text().startswith("layer,head")
    assert sorted(os.listdir(tmp_path)) == ["corpus", "latest", "results"]
    assert sorted(os.listdir(tmp_path / "results")) == ["run1"]  # no .run1.old-*, no lock


# --- 5. only its own leftovers -------------------------------------------------------------------


def test_leftovers_without_the_mark_are_never_touched(tmp_path, caplog):
    caplog.set_level("WARNING", logger="headsurgeon")
    out = tmp_path / "out"
    for name in (".out.tmp-0123456789ab", ".out.old-0123456789ab"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("user data")
    (tmp_path / ".out.tmp-ba9876543210").write_text("a file")
    (tmp_path / ".out.old-ba9876543210").symlink_to(tmp_path / ".out.old-0123456789ab")
    before = snapshot(tmp_path)
    with claim_output(out):
        pass
    assert snapshot(tmp_path) == before  # not removed, and no .out.old-* put back as out
    assert caplog.text.count("nothing proves headsurgeon wrote all of it") == 4


def test_an_old_copy_holding_a_users_file_is_never_removed(tmp_path, caplog):
    out = tmp_path / "out"
    old = tmp_path / ".out.old-0123456789ab"  # a replaced output, killed before its removal
    old.mkdir()
    (old / "heads.csv").write_text("the previous result")
    mark_folder(old, "write_classification")
    (old / "notes.txt").write_text("added by the user before the run replaced it")
    out.mkdir()  # the new output is in place
    before = snapshot(tmp_path)
    with claim_output(out, overwrite=True):
        pass
    assert snapshot(tmp_path) == before
    assert "nothing proves headsurgeon wrote all of it" in caplog.text


def test_marked_leftovers_are_removed_and_a_replaced_output_put_back(tmp_path):
    out = tmp_path / "out"
    for name, files in ((".out.tmp-0123456789ab", ["model/"]), (".out.old-ba9876543210", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "heads.csv").write_text("the previous result")
        mark_folder(tmp_path / name, "write_classification", files)
    with claim_output(out, overwrite=True):
        assert (out / "heads.csv").read_text() == "the previous result"
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("kind", ["a note", "empty", "folder", "symlink"])
def test_a_lock_file_that_is_not_ours_is_refused_and_kept(kind, tmp_path):
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    if kind == "a note":
        lock.write_text("my own lock notes, not a pid\nsecond line\n")
    elif kind == "empty":
        lock.write_text("")
    elif kind == "folder":
        lock.mkdir()
        (lock / "inside.txt").write_text("mine")
    else:
        (tmp_path / "real.txt").write_text("mine")
        lock.symlink_to(tmp_path / "real.txt")
    before = snapshot(tmp_path)
    with pytest.raises(OutputExistsError, match="is not a headsurgeon lock file") as error:
        with claim_output(out):
            pytest.fail("claimed through a lock file that is not ours")
    assert "\n" not in str(error.value) and str(lock) in str(error.value)
    assert snapshot(tmp_path) == before


def test_a_dead_runs_lock_in_our_format_is_taken_over_and_removed(tmp_path):
    out = tmp_path / "out"
    (tmp_path / ".out.lock").write_text("999999999 elsewhere 2026-01-01T00:00:00+00:00\n")
    with claim_output(out):
        assert (tmp_path / ".out.lock").read_text().split()[0] == str(os.getpid())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["folder", "empty folder", "file", "symlink"])
def test_a_users_partial_is_one_line_and_untouched(
    kind, bloom_dir, text_file, tmp_path, no_model, capsys
):
    out = tmp_path / "r8"
    partial = tmp_path / "r8.partial"
    if kind == "folder":
        partial.mkdir()
        (partial / "run.json").write_text("{}")  # looks like a run, but no mark says so
        (partial / "draft.md").write_text("my draft")
    elif kind == "empty folder":
        partial.mkdir()
    elif kind == "file":
        partial.write_text("my file")
    else:
        (tmp_path / "elsewhere").mkdir()
        partial.symlink_to(tmp_path / "elsewhere")
    before = snapshot(tmp_path)
    for extra in ([], ["--overwrite"], ["--resume", out]):
        argv = [bloom_dir, "--texts", text_file, "--heads", "L0H0", *extra]
        if not extra or extra[0] != "--resume":
            argv += ["--out", out]
        line = error_line(REPAIR, argv, capsys)
        assert f"{partial} is in the way" in line and "left as it is" in line, line
    assert snapshot(tmp_path) == before


def test_a_marked_partial_that_never_trained_is_removed(bloom_dir, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    with atomic_directory(partial, writer=WORK_WRITER) as tmp:
        atomic_write_text(tmp / "run.json", "{}")  # a run killed in its first census
    argv = [
        bloom_dir,
        "--texts",
        text_file,
        "--corpus",
        text_file,
        "--eval-corpus",
        text_file,
        "--allow-eval-on-train",
        "--seq-len",
        "32",
        "--n-seqs",
        "4",
        "--train-seq-len",
        "32",
        "--quiet",
        "--threads",
        "1",
        "--out",
        out,
    ]
    line = error_line(REPAIR, argv, capsys)
    assert "nothing to repair" in line  # the healthy model: this run never trained either
    assert sorted(os.listdir(tmp_path)) == ["corpus"]  # both work folders gone, nothing beside


# --- 6. --resume of a finished run -------------------------------------------------------------


def test_resume_of_a_finished_run_says_it_is_finished(bloom_dir, tmp_path, no_model, capsys):
    out = marked_output(tmp_path / "r8", "write_report", **{"report.md": "# done"})
    before = snapshot(tmp_path)
    line = error_line(REPAIR, [bloom_dir, "--resume", out], capsys)
    assert line == (
        f"error: {out} holds a finished repair (report.md); nothing to resume: open it, or "
        "start a new run with another --out"
    )
    assert "--overwrite" not in line
    # With an interrupted run that is to replace it (a run started with --overwrite).
    with atomic_directory(tmp_path / "r8.partial", writer=WORK_WRITER) as tmp:
        atomic_write_text(tmp / "run.json", "{}")
    before = snapshot(tmp_path)
    line = error_line(REPAIR, [bloom_dir, "--resume", out], capsys)
    assert f"continue with --resume {out} --overwrite" in line
    assert snapshot(tmp_path) == before


def test_resume_from_a_run_file_that_is_no_regular_file(bloom_dir, tmp_path, no_model, capsys):
    partial = tmp_path / "r8.partial"
    with atomic_directory(partial, writer=WORK_WRITER):
        pass
    os.mkfifo(partial / "run.json")  # opened, it would block the run forever
    before = snapshot(tmp_path)
    line = error_line(REPAIR, [bloom_dir, "--resume", tmp_path / "r8"], capsys)
    assert line.startswith(f"error: resume file {partial / 'run.json'} is a FIFO (named pipe)")
    assert snapshot(tmp_path) == before


# --- 7. end to end ------------------------------------------------------------------------------


def test_classify_marks_its_output_and_replaces_only_that(bloom_dir, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [str(bloom_dir), "--texts", str(text_file), *FAST, "--out", str(out)]
    assert CLASSIFY(argv) == 0
    mark = read_mark(out)
    assert mark.writer == "write_classification" and "heads.csv" in mark.files
    assert foreign_files(out) == []
    assert CLASSIFY([*argv, "--overwrite"]) == 0  # its own output: replaced
    (out / "my-analysis.ipynb").write_text("{}")
    before = snapshot(tmp_path)
    line = error_line(CLASSIFY, [*argv, "--overwrite"], capsys)
    assert f"output folder {out} already holds files headsurgeon did not write: " in line
    assert "my-analysis.ipynb; choose another folder" in line
    assert snapshot(tmp_path) == before
    assert sorted(os.listdir(tmp_path)) == ["corpus", "out"]


@pytest.mark.slow  # a subprocess
def test_overwrite_of_a_home_style_folder_from_the_shell(tmp_path):
    home = tmp_path / "home"
    folder = documents(home / "somefolder")
    before = snapshot(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "headsurgeon",
            "classify",
            "organism-injured",
            "--n-seqs",
            "2",
            "--seq-len",
            "16",
            "--threads",
            "1",
            "--out",
            str(folder),
            "--overwrite",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "HOME": str(home)},
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()  # no census progress: it never started
    assert line.startswith(f"error: output folder {folder} already holds files headsurgeon ")
    assert snapshot(tmp_path) == before
