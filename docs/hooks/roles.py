"""MkDocs hook: the docstrings' Sphinx roles become links in the API reference.

The docstrings are read in ``help()`` too, so they name other objects the Sphinx way
(:class:`~distamp.DistAMP`, :meth:`state_dict`), which mkdocstrings renders as the role's text
followed by code. Before mkdocs-autorefs resolves the cross-references of every page (its
``on_env`` runs late, at priority -50; this one runs at the default, 0), each role becomes an
optional autoref to the first candidate target that the site documents: a dotted name as
written, then the name inside the documented object the role appears under, inside that object's
parents, and inside the ``distamp`` package (a leading ``.`` makes a name relative to those only).
A target the site does not document stays code. ``~`` shows the last component only, as in
Sphinx, and an explicit ``title <target>`` keeps its title.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from typing import Any

PACKAGE = "distamp"
ROLE = re.compile(
    r":(?:py:)?(?:class|meth|mod|func|attr|data|exc|obj|const):<code>(?P<text>[^<]*)</code>"
)
_HEADING = re.compile(r'<h[1-6] id="(?P<id>[^"]+)" class="doc doc-heading"')
_EXPLICIT = re.compile(r"^(?P<title>.+?)\s*&lt;(?P<target>[^&]+)&gt;$")  # :class:`T <a.b.T>`


def candidates(target: str, scope: str) -> list[str]:
    """The identifiers ``target`` (without ``~``) may mean, best first, where it is written in
    the docstring of the object ``scope`` (a dotted path; empty outside any object)."""
    name = target.lstrip(".")
    parts = scope.split(".") if scope else []
    scopes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    absolute = "." in target and not target.startswith(".")  # a bare name is never global
    found = [name] if absolute else []
    found += [f"{prefix}.{name}" for prefix in [*scopes, PACKAGE]]
    return list(dict.fromkeys(found))


def rewrite(content: str, documented: Callable[[str], bool]) -> tuple[str, int, int]:
    """``content`` (a page's HTML) with its roles rewritten; also how many became links and how
    many stayed code. ``documented(identifier)`` says whether the site documents it."""
    headings = [(m.start(), m["id"]) for m in _HEADING.finditer(content)]
    starts = [start for start, _ in headings]
    counts = [0, 0]

    def replace(match: re.Match[str]) -> str:
        text = match["text"].strip()
        explicit = _EXPLICIT.match(text)
        target = explicit["target"].strip() if explicit else text
        short = target.startswith("~")
        target = target.lstrip("~")
        bare = target.removesuffix("()")
        title = bare.lstrip(".").rsplit(".", 1)[-1] if short else target.lstrip(".")
        if explicit:
            title = explicit["title"]
        index = bisect.bisect_right(starts, match.start()) - 1
        scope = headings[index][1] if index >= 0 else ""
        for identifier in candidates(bare, scope):
            if documented(identifier):
                counts[0] += 1
                return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'
        counts[1] += 1
        return f"<code>{title}</code>"

    return ROLE.sub(replace, content), counts[0], counts[1]


def on_env(env: Any, /, *, config: Any, files: Any) -> Any:
    """Rewrite every page's roles once all pages are rendered, so every target is known."""
    autorefs = config.plugins["autorefs"]

    def documented(identifier: str) -> bool:
        try:
            autorefs.get_item_url(identifier)
        except KeyError:
            return False
        return True

    for file in files:
        page = file.page
        if page is not None and page.content:
            page.content, _, _ = rewrite(page.content, documented)
    return env
