"""The library's defaults (headsurgeon.defaults): a leaf the verbs and the tools' parsers both
read, so there is no copy to hold equal; the names the blindness tool takes without files."""

from __future__ import annotations

from headsurgeon import census, defaults
from headsurgeon.classify import Thresholds
from headsurgeon.loading import model_shape


def test_the_library_uses_the_defaults_themselves():
    assert census.GU_PROTOCOL is defaults.GU_PROTOCOL
    assert Thresholds().sink == defaults.SINK_THRESHOLD


def test_every_shape_name_is_one_model_shape_knows_without_a_folder():
    for name in defaults.SHAPE_NAMES:
        assert model_shape(name).positional == "alibi"
