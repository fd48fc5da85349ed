"""Model names without heavy imports (headsurgeon.model_names): the shipped snapshot of
TransformerLens's names, exact for the installed version, and what a MODEL argument names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from headsurgeon import backend, model_names
from headsurgeon.errors import ModelNotFoundError, UnknownModelError
from headsurgeon.model_names import (
    ORGANISM_DIR,
    SNAPSHOT_FILE,
    check_hub_model,
    hub_cache_folder,
    hub_names,
    installed_transformer_lens,
    locate_model,
    snapshot_names,
)


def test_the_snapshot_is_the_installed_transformer_lens_own_table():
    """One table for every TransformerLens it was read from (3.x and 4.x have the same)."""
    version = installed_transformer_lens()
    snapshot = json.loads(SNAPSHOT_FILE.read_text(encoding="utf-8"))
    assert version in snapshot["transformer_lens"], (
        f"{SNAPSHOT_FILE.name} was read from TransformerLens {snapshot['transformer_lens']}, "
        f"{version} is installed: run analyses/hub_names.py (unknown model names are slow "
        "until then)"
    )
    assert snapshot["names"] == backend.hub_names()
    assert snapshot_names() == backend.hub_names()


def test_another_version_asks_transformer_lens_itself(monkeypatch):
    monkeypatch.setattr(model_names, "installed_transformer_lens", lambda: "3.0.0rc1")
    snapshot_names.cache_clear()
    try:
        monkeypatch.setattr(backend, "hub_names", lambda: {"only-this": "org/Only-This"})
        assert snapshot_names() is None
        assert hub_names() == {"only-this": "org/Only-This"}
        assert locate_model("ONLY-THIS") == ("ONLY-THIS", None, "org/Only-This")
    finally:
        snapshot_names.cache_clear()


def test_a_model_argument_is_an_organism_a_folder_or_a_hub_name(tmp_path):
    assert locate_model("organism") == ("organism", ORGANISM_DIR / "organism", None)
    assert locate_model(tmp_path) == (tmp_path.name, tmp_path, None)
    assert locate_model("BLOOM-560M") == ("BLOOM-560M", None, "bigscience/bloom-560m")
    assert locate_model("GPT2")[2] == "gpt2"


@pytest.mark.parametrize("name", ["./missing", "a/b/c", "~/missing-model"])
def test_a_path_that_does_not_exist_is_one_line(name):
    with pytest.raises(ModelNotFoundError, match=f"model folder {name} does not exist"):
        locate_model(name)


def test_an_unknown_name_names_the_closest():
    with pytest.raises(UnknownModelError, match="did you mean bloom-560m") as info:
        locate_model("bloom-56m")
    assert "organism-injured" in str(info.value)


@pytest.mark.slow  # a subprocess
def test_an_unknown_name_is_answered_without_transformer_lens():
    code = (
        "import sys\n"
        "from headsurgeon.model_names import locate_model\n"
        "try:\n"
        "    locate_model('bloom-56m')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
        "print(sorted(m for m in ('torch', 'transformer_lens') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["UnknownModelError", "[]"]


@pytest.fixture()
def hub_cache(monkeypatch, tmp_path):
    """An empty Hugging Face cache, offline (the hub constants are read at import: patched)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_the_cache_lookup_finds_a_cached_hub_model_and_refuses_a_missing_one(hub_cache):
    with pytest.raises(ModelNotFoundError, match="bigscience/bloom-560m is not in the Hugging"):
        check_hub_model("bigscience/bloom-560m")
    assert hub_cache_folder("bigscience/bloom-560m") is None
    # The cache's layout: refs/main names the commit whose snapshot folder holds the files.
    repo, commit = hub_cache / "models--bigscience--bloom-560m", "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert hub_cache_folder("bigscience/bloom-560m") == repo / "snapshots" / commit
    check_hub_model("bigscience/bloom-560m")  # cached: no refusal, offline or not
    assert hub_cache_folder("bigscience/bloom-1b7") is None
