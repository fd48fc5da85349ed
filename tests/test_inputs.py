"""Every file the tools read is a regular file, read bounded (issue 23, parts 3 and 5).

A FIFO, a device, a folder, a dangling symlink, a symlink loop, a huge sparse file, an unreadable
or non-UTF-8 file given as ``--texts`` or standing in a model folder as ``config.json``,
``model.safetensors``, ``tokenizer.json`` or ``headsurgeon.json`` is one ``headsurgeon.errors``
line naming the file and what it is, found without blocking and without reading it whole. Each
case runs in a thread with a time limit, so a regression fails here instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import tracemalloc
from pathlib import Path

import pytest

import headsurgeon.cli
import headsurgeon.cli.classify
from headsurgeon import load_model, model_shape
from headsurgeon.cli import run
from headsurgeon.data import read_texts
from headsurgeon.errors import CheckpointError, DataError, HeadsurgeonError
from headsurgeon.inputs import describe_kind, read_json, read_text
from headsurgeon.loading.checks import check_checkpoint
from headsurgeon.loading.facts import model_metadata

LIMIT_S = 30  # generous on a busy machine; a hang or a whole read of 2 GB takes far longer
ROOT = os.geteuid() == 0  # root reads files whatever their permissions say


def finishes(call, seconds: float = LIMIT_S) -> BaseException | None:
    """Run ``call()`` in a daemon thread; return what it raised (None if nothing), failing the
    test if it is still running after ``seconds``."""
    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            call()
        except BaseException as e:  # SystemExit from a CLI included
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: blocked or reading unbounded"
    return box.get("error")


@contextlib.contextmanager
def alarm(seconds: int = LIMIT_S):
    """A time limit in the main thread, for the CLIs (which install signal handlers, so they
    cannot run in another thread): SIGALRM interrupts a blocked open or read."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: blocked or reading unbounded")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def cli_error(argv: list[str], capsys) -> str:
    """Run the classify CLI under a time limit, expecting exit 2 and one ``error:`` line."""
    with alarm(), pytest.raises(SystemExit) as exit_info:
        run("classify", argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture()
def fifos():
    """FIFOs made by a test; any reader left blocked on one is released afterwards."""
    made: list[Path] = []
    yield made
    for fifo in made:
        try:  # O_RDWR never blocks on Linux, and lets a blocked reader's open return
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        except OSError:
            pass


def hostile(path: Path, kind: str, fifos: list[Path]) -> str:
    """Put a ``kind`` of non-file (or bad file) at ``path``; return what its message must say."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        fifos.append(path)
        return "is a FIFO (named pipe), not a regular file"
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
        return "is a character device, not a regular file"
    if kind == "dev-null":
        path.symlink_to("/dev/null")
        return "is a character device, not a regular file"
    if kind == "folder":
        path.mkdir()
        return "is a folder"
    if kind == "dangling":
        path.symlink_to(path.parent / "nowhere")
        return "is a broken symbolic link, not a regular file"
    if kind == "loop":
        partner = path.with_name(path.name + ".partner")
        path.symlink_to(partner)
        partner.symlink_to(path)
        return "is a symbolic link loop, not a regular file"
    if kind == "sparse":  # 2 GiB of NUL bytes that take no disk space
        path.touch()
        os.truncate(path, 2 << 30)
        return "such a file can plausibly be"
    if kind == "unreadable":
        path.write_text("{}")
        path.chmod(0)
        return "is not readable (permissions)"
    raise AssertionError(kind)


KINDS = ["fifo", "dev-zero", "dev-null", "folder", "dangling", "loop", "sparse"]
if not ROOT:
    KINDS.append("unreadable")


def one_line(error: BaseException | None, kind: type[BaseException] = HeadsurgeonError) -> str:
    assert isinstance(error, kind), repr(error)
    message = str(error)
    assert message and "\n" not in message
    return message


# --- the readers themselves -----------------------------------------------------------------


def test_describe_kind():
    assert describe_kind("/dev/zero") == "a character device"
    assert describe_kind("/") == "a folder"
    assert describe_kind("/no/such/file") == "missing"
    assert describe_kind(__file__) is None


@pytest.mark.parametrize("kind", KINDS)
def test_read_text_and_json_refuse_what_is_no_regular_file(tmp_path, fifos, kind):
    path = tmp_path / "input.txt"
    expected = hostile(path, kind, fifos)
    for read in (read_text, read_json):
        message = one_line(finishes(lambda read=read: read(path, "text file")), DataError)
        assert message.startswith(f"text file {path} ") and expected in message, message


def test_a_sparse_binary_file_is_found_from_its_first_chunk(tmp_path):
    """512 MiB of NUL bytes, under the 1 GiB bound: refused after one chunk, not read whole."""
    path = tmp_path / "sparse.txt"
    path.write_bytes(b"text first ")
    os.truncate(path, 512 << 20)
    tracemalloc.start()
    try:
        message = one_line(finishes(lambda: read_texts([path])), DataError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "is not text (it holds NUL bytes" in message
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB allocated: the file was read whole"


def test_a_compressed_text_is_bounded_when_decompressed(tmp_path):
    import gzip

    path = tmp_path / "bomb.txt.gz"
    path.write_bytes(gzip.compress(b"a" * (3 << 20)))  # 3 MiB of text in a few KiB
    message = one_line(finishes(lambda: read_text(path, "text file", max_bytes=1 << 20)))
    assert "holds more than 1.0 MiB of text" in message


def test_json_that_is_no_json_object_is_one_line(tmp_path):
    path = tmp_path / "x.json"
    for raw, expected in [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"1" * 5000, "is not readable JSON"),  # beyond Python's 4300-digit integer limit
        (b'{"a": "\xff"}', "is not readable JSON (not UTF-8: byte 0xff at offset 7)"),
        (b"[1]", "holds a JSON list, not an object"),
    ]:
        path.write_bytes(raw)
        assert expected in one_line(finishes(lambda: read_json(path, "config file")))


# --- --texts on the command line ------------------------------------------------------------


@pytest.mark.parametrize("kind", [*KINDS, "latin1"])
def test_texts_option_is_one_line_and_never_hangs(
    kind, bloom_dir, tmp_path, fifos, capsys, monkeypatch
):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before --texts was checked")

    monkeypatch.setattr(headsurgeon.cli.loads, "load_model", refuse)
    path = tmp_path / "corpus.txt"
    if kind == "latin1":
        path.write_bytes("caf\xe9".encode("latin-1"))
        expected = "is not UTF-8 (byte 0xe9 at offset 3)"
    else:
        expected = hostile(path, kind, fifos)
    argv = [str(bloom_dir), "--texts", str(path), "--out", str(tmp_path / "out")]
    line = cli_error(argv, capsys)
    assert line.startswith(f"error: --texts: text file {path} ") and expected in line, line
    assert not (tmp_path / "out").exists()


# --- files of a model folder ----------------------------------------------------------------


@pytest.fixture()
def folder(bloom_dir, tmp_path):
    return Path(shutil.copytree(bloom_dir, tmp_path / "ckpt"))


@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors", "tokenizer.json", "headsurgeon.json"]
)
@pytest.mark.parametrize("kind", KINDS)
def test_a_model_file_that_is_no_regular_file(folder, fifos, name, kind):
    path = folder / name
    expected = hostile(path, kind, fifos)
    if kind == "sparse" and name == "model.safetensors":
        expected = "is not a valid safetensors file"  # weights have no size bound: their header
    for call in (load_model, check_checkpoint):
        message = one_line(finishes(lambda call=call: call(folder)), CheckpointError)
        assert message.startswith(f"{path} ") and expected in message, message


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "loop"])
def test_shape_and_metadata_of_a_folder_never_hang(folder, fifos, kind):
    expected = hostile(folder / "config.json", kind, fifos)
    assert expected in one_line(finishes(lambda: model_shape(folder)), CheckpointError)
    expected = hostile(folder / "headsurgeon.json", kind, fifos)
    assert expected in one_line(finishes(lambda: model_metadata(folder)), CheckpointError)


def test_non_utf8_model_files(folder):
    (folder / "headsurgeon.json").write_bytes(b'{"name": "\xe9"}')
    message = one_line(finishes(lambda: load_model(folder)), CheckpointError)
    assert message.startswith(f"{folder / 'headsurgeon.json'} is not readable JSON (not UTF-8")


def test_a_weights_file_with_bytes_past_its_tensors(folder):
    with open(folder / "model.safetensors", "ab") as f:
        f.write(b"\0" * 64)
    message = one_line(finishes(lambda: load_model(folder)), CheckpointError)
    assert "model.safetensors is not a valid safetensors file (64 bytes follow the" in message


def test_a_model_folder_fifo_through_the_cli(folder, fifos, tmp_path, capsys):
    hostile(folder / "config.json", "fifo", fifos)
    line = cli_error([str(folder), "--out", str(tmp_path / "out")], capsys)
    assert f"{folder / 'config.json'} is a FIFO (named pipe), not a regular file" in line, line
