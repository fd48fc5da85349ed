"""``python -m headsurgeon.classify``, deprecated: one line on stderr names ``python -m headsurgeon
classify`` (or ``headsurgeon-classify``), then the tool runs as before; this entry goes in the next
release.
"""

from headsurgeon.cli import deprecated_entry

__all__ = []

if __name__ == "__main__":
    deprecated_entry("classify")
