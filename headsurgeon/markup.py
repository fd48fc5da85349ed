"""User text in the Markdown the tools write, shown as written: never markup, a link or an image.

A repair's ``report.md``, the page that renders it and the model card of an exported checkpoint
(rendered by Hugging Face) hold names the user chose: a folder named ``![t](http:evil.example)``
would make the page fetch a remote image, one named ``<img src=...>`` would be raw HTML in the card.
Every name enters Markdown through :func:`markdown_text`, and HTML through ``html.escape``; the
page's renderer also follows only :func:`local_link` addresses, so even Markdown that was not
escaped loads nothing off the machine.
"""

from __future__ import annotations

import re

from headsurgeon.errors import shown

__all__ = ["local_link", "markdown_text"]

# Every ASCII punctuation character that starts or ends markup in CommonMark or the extensions its
# renderers add (GitHub's tables, strike-through and autolinks such as x@y or http://x, Hugging
# Face's $math$, :emoji:); CommonMark shows a backslash-escaped punctuation character as itself.
# The characters of everyday names stay readable (bloom_560m-v1.1/x+y) where they are inert:
# - + = only start a list or heading at a line's start, "." only in "www." (an autolink) or
# after a line's leading digits and before a space (a numbered list), and a run of "_" between
# letters or digits never opens or closes emphasis. , ' " ; % ? / are never markup.
_MARKUP = re.compile(r"[\\`*{}\[\]()<>#!|~&:@$^]|^[-+=]|(?i:(?<=www))\.|^\d+\.(?= |$)|_+")
_WORD = re.compile(r"[^\W_]")  # a letter or digit: an "_" run between two is inert


def _escaped(match: re.Match) -> str:
    found, text = match[0], match.string
    if found[0] == "_":
        before, after = text[match.start() - 1 : match.start()], text[match.end() : match.end() + 1]
        return found if _WORD.match(before) and _WORD.match(after) else found.replace("_", "\\_")
    return found[:-1] + "\\" + found[-1] if found[0].isdigit() else "\\" + found


def markdown_text(text: object) -> str:
    r"""``text`` as Markdown shows it literally, on one line: Markdown's punctuation
    backslash-escaped where it could be markup (no emphasis, link, image, raw HTML, entity,
    table cell, list or heading can start in it) and line breaks and other control characters
    written as their Python escapes (:func:`headsurgeon.errors.shown`), so a name cannot start a
    line of its own.

    >>> print(markdown_text("![t](http:evil.example) <img src=x>"))
    \!\[t\]\(http\:evil.example\) \<img src=x\>
    >>> print(markdown_text("- a\n# b | c _d_ www.e"))
    \- a\\n\# b \| c \_d\_ www\.e
    >>> print(markdown_text("bigscience/bloom-560m"), markdown_text("my_model-1.1b+lora"))
    bigscience/bloom-560m my_model-1.1b+lora
    >>> print(markdown_text("1. x"), markdown_text("1.1b"))
    1\. x 1.1b
    """
    return _MARKUP.sub(_escaped, shown(text, keep=""))


def local_link(url: str) -> bool:
    """Whether ``url``, a link's or an image's address, names a path relative to the page: no
    scheme (``http:``, ``javascript:``, ``data:``), no host (``//host``), not absolute, no
    backslash or whitespace (a browser reads ``\\\\`` as ``//`` and drops tabs), so following it
    reads only files beside the page.

    >>> [local_link(u) for u in ("training.png", "model/README.md", "#pass-1", "a%20b.png")]
    [True, True, True, True]
    >>> [local_link(u) for u in ("http:evil.example", "//evil.example/x", "/etc/passwd",
    ...                          "\\\\\\\\evil\\\\x", "javascript:alert(1)", "data:image/png,")]
    [False, False, False, False, False, False]
    """
    first = re.split(r"[/?#]", url, maxsplit=1)[0]
    return not (":" in first or url.startswith("/") or "\\" in url or any(c <= " " for c in url))
