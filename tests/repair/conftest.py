"""Fixtures of the repair tests: the text file the command-line runs train on."""

from __future__ import annotations

import pytest
from conftest import TEXT


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT)
    return path
