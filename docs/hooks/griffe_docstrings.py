"""A griffe extension: headsurgeon's docstrings, written to be read as text, rendered as Markdown.

The docstrings are prose with reST-style roles (``:func:`x```), doctests and aligned
"Exports:" tables. Markdown would run the doctests and the tables into paragraphs, so:
    - a role is dropped, keeping its code (``:class:`~a.B``` -> ```B```, as Sphinx shows it);
    - a run of doctest lines (from ``>>>`` to the next blank line) becomes a ``pycon`` block;
    - an "Exports:" block (a name, two spaces or more, what it is; continuation lines indented
      further) becomes a two-column table, which wraps to the page's width;
    - any other indented block right under a line ending in ``:`` becomes a code block, keeping
      its alignment (Markdown needs a blank line before it);
    - the first sentence is put on the first line, whole: the API pages' summary tables show a
      docstring's first line, and the source wraps sentences at 100 columns.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def _fence_doctests(lines: list[str]) -> list[str]:
    out: list[str] = []
    fenced = False  # inside a fence already (a docstring that has one, or a second pass)
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not lines[i].lstrip().startswith(">>>"):
            out.append(lines[i])
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i][indent:])
            i += 1
        if out and out[-1].strip():
            out.append("")
        out += ["```pycon", *block, "```"]
    return out


def _separate_indented_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    for line in lines:
        previous = out[-1] if out else ""
        starts_block = line.startswith("    ") and not previous.startswith(" ")
        if starts_block and previous.rstrip().endswith(":") and previous.strip():
            out.append("")
        out.append(line)
    return out


# A sentence ends at ". " outside code and brackets, but not after these abbreviations.
ABBREVIATIONS = ("e.g.", "i.e.", "cf.", "vs.", "etc.", "approx.")


def _sentence_end(text: str) -> int:
    """The index just past the first sentence of ``text`` (its length when it is one)."""
    code, depth = False, 0
    for i, char in enumerate(text):
        if char == "`":
            code = not code
        elif not code and char in "([{":
            depth += 1
        elif not code and char in ")]}":
            depth = max(depth - 1, 0)
        elif not code and not depth and char in ".?!" and text[i + 1 : i + 2] == " ":
            if not text[: i + 1].endswith(ABBREVIATIONS):
                return i + 1
    return len(text)


def _first_sentence_first(lines: list[str]) -> list[str]:
    """The first paragraph's first sentence as line one, the rest of the paragraph after it
    (Markdown renders the paragraph the same; the summary tables show line one)."""
    end = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    if end < 2 or any(line.startswith((" ", ">>>")) for line in lines[:end]):
        return lines
    paragraph = " ".join(line.strip() for line in lines[:end])
    cut = _sentence_end(paragraph)
    rest = paragraph[cut:].strip()
    return [paragraph[:cut], *([rest] if rest else []), *lines[end:]]


def _cell(text: str) -> str:
    return text.strip().replace("|", "\\|")


def _exports_tables(lines: list[str]) -> list[str]:
    """Each ``Exports:`` block as a Markdown table: ``| name | what |``."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if line.strip() != "Exports:":
            continue
        rows: list[list[str]] = []
        while i < len(lines) and lines[i].startswith("    ") and lines[i].strip():
            entry = lines[i][4:]
            if entry.startswith(" ") and rows:  # a continuation of the row above
                rows[-1][1] = f"{rows[-1][1]} {entry.strip()}".strip()
            else:
                parts = re.split(r"\s{2,}", entry.strip(), maxsplit=1)
                rows.append([parts[0], parts[1] if len(parts) > 1 else ""])
            i += 1
        out[-1] = "**Exports**"
        out += ["", "| name | what |", "|---|---|"]
        out += [f"| `{_cell(name)}` | {_cell(what)} |" for name, what in rows]
        out.append("")
    return out


def markdown(text: str) -> str:
    """A docstring's text as the Markdown mkdocstrings renders."""
    text = ROLE.sub(_role, text)
    lines = _first_sentence_first(text.splitlines())
    lines = _separate_indented_blocks(_exports_tables(lines))
    return "\n".join(_fence_doctests(lines))


class MarkdownDocstrings(griffe.Extension):
    """Rewrite every docstring once it is loaded (see the module docstring)."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
