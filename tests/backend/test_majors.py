"""The two backends, TransformerLens 3.x's and 4.x's: the same methods, one chosen at import."""

from __future__ import annotations

import inspect

from headsurgeon import backend
from headsurgeon.backend.tl3 import TransformerLens3
from headsurgeon.backend.tl4 import TransformerLens4


def public(cls: type) -> dict[str, object]:
    return {name: value for name, value in vars(cls).items() if not name.startswith("_")}


def test_both_majors_have_the_same_methods_and_facts():
    tl3, tl4 = public(TransformerLens3), public(TransformerLens4)
    assert sorted(tl3) == sorted(tl4)
    for name, method in tl3.items():
        if callable(method):
            ours, theirs = inspect.signature(method), inspect.signature(tl4[name])
            assert ours.parameters == theirs.parameters, name
        else:
            assert type(method) is type(tl4[name]), name


def test_the_installed_major_is_chosen_once():
    chosen = TransformerLens4 if backend.MAJOR >= 4 else TransformerLens3
    assert type(backend.BACKEND) is chosen
    assert backend.Model is backend.BACKEND.model_class()
    assert backend.SUPPORTED == chosen.supported
