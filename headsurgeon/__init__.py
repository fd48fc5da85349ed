"""headsurgeon: census, underflow blindness and surgical repair of ALiBi attention heads.

The public API gathers here; each concept lives in its own module (see README.md).
"""

from headsurgeon.models import load_model, model_info, model_shape, save_hf

__all__ = ["load_model", "model_info", "model_shape", "save_hf"]
__version__ = "0.1.0"
