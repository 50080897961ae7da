"""A griffe extension for the API reference: the Sphinx roles of titan's docstrings
(``:class:`~titan_models.StepContext```, ``:meth:`step```...) rendered as links.

The docstrings are Markdown, but some name objects as reST roles; markdown would show
them as literal text. Each role becomes a cross-reference to the object when the name
resolves from the docstring's scope (an optional autorefs tag: a link where the object is
on a page, plain code where it is not), else inline code.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

# :class:`Name`, :py:meth:`~a.b.c`, :func:`title <target>`.
ROLE = re.compile(
    r":(?:py:)?[a-z]+:`(?P<tilde>~?)(?:(?P<title>[^`<]*?)\s*<(?P<t>[^`>]+)>|(?P<name>[^`]+))`"
)


def _resolve(obj: griffe.Object, name: str, loader: griffe.GriffeLoader) -> str | None:
    """The full path ``name`` means in ``obj``'s docstring, or None."""
    name = name.lstrip(".").removesuffix("()")
    if name.startswith("titan_"):  # a full path; autorefs finds it wherever it is rendered
        return name
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            return scope.resolve(name.split(".", 1)[0]) + name[len(name.split(".", 1)[0]) :]
        except (griffe.NameResolutionError, griffe.AliasResolutionError, KeyError):
            scope = scope.parent
    return None


def render_roles(text: str, resolve: Any) -> str:
    """``text`` with every role replaced by a cross-reference (``resolve(name)`` gives the
    target or None) or by inline code."""

    def one(match: re.Match[str]) -> str:
        target = match["t"] or match["name"]
        shown = match["title"] or target.lstrip(".")
        if match["tilde"]:
            shown = shown.rsplit(".", 1)[-1]
        code = f"<code>{html.escape(shown)}</code>"
        path = resolve(target)
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    return ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring once the packages are loaded."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None and ":`" in obj.docstring.value:
            obj.docstring.value = render_roles(
                obj.docstring.value, lambda name: _resolve(obj, name, loader)
            )
