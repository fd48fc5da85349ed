"""User text in the Markdown the tools write, shown as written: never markup, a link or an image.

Exports:
    markdown_text(text)   user text (a model, corpus, file or column name, a label) as Markdown
                          shows it literally
    local_link(url)       whether a link's or image's address names a file beside the page

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
# renderers add (GitHub's tables, strike-through and autolinks such as www.x or x@y, Hugging
# Face's $math$, :emoji:); CommonMark shows a backslash-escaped punctuation character as itself.
# Left as they are, for names that stay readable: - / , ' " ; = % ? (markup only at a line
# start, where a leading - or = is escaped).
_MARKUP = re.compile(r"[\\`*_{}\[\]()<>#+.!|~&:@$^]|^[-=]")


def markdown_text(text: object) -> str:
    r"""``text`` as Markdown shows it literally, on one line: Markdown's punctuation
    backslash-escaped (no emphasis, link, image, raw HTML, entity, table cell or heading can
    start in it) and line breaks and other control characters written as their Python escapes
    (:func:`headsurgeon.errors.shown`), so a name cannot start a line of its own.

    >>> print(markdown_text("![t](http:evil.example) <img src=x>"))
    \!\[t\]\(http\:evil\.example\) \<img src=x\>
    >>> print(markdown_text("- a\n# b | c"))
    \- a\\n\# b \| c
    >>> print(markdown_text("bigscience/bloom-560m"))
    bigscience/bloom-560m
    """
    return _MARKUP.sub(lambda m: "\\" + m[0], shown(text, keep=""))


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
