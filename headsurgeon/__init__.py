"""headsurgeon: census, underflow blindness and surgical repair of ALiBi attention heads.

The public API gathers here; each concept lives in its own module (see README.md).
"""

from headsurgeon.census import run_census
from headsurgeon.classify import Thresholds, classify_heads, threshold_sweep
from headsurgeon.models import load_model, model_info, model_shape, save_hf

__all__ = [
    "Thresholds",
    "classify_heads",
    "load_model",
    "model_info",
    "model_shape",
    "run_census",
    "save_hf",
    "threshold_sweep",
]
__version__ = "0.1.0"
