"""What the benchmarks share: model shapes given on the command line.

parse_shape(text)   a BLOOM name (bloom-560m, ...) or LAYERSxHEADSxWIDTH for quick trials
"""

from __future__ import annotations

from headsurgeon.loading import ModelShape, model_shape


def parse_shape(text: str) -> ModelShape:
    """A BLOOM name, or ``LAYERSxHEADSxWIDTH`` (vocabulary 4096) for quick trial runs."""
    parts = text.split("x")
    if len(parts) == 3 and all(p.isdigit() for p in parts):
        n_layers, n_heads, d_model = map(int, parts)
        return ModelShape(n_layers, n_heads, d_model, d_vocab=4096, n_ctx=2048)
    return model_shape(text)
