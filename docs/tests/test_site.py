"""The built site works as a user opens it: from disk (file://), every link a file that
exists, search included, no Sphinx role shown as text, nothing fetched from the network.
Checks the site CI just built (next to the pages TITAN_REFERENCE_PAGES names), else builds
one (about 20 s)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import gen_reference
import pytest

# as written, or as markdown renders it (the role name, then the name as code)
ROLE = re.compile(r":(?:py:)?(?:attr|meth|func|class|mod|data|exc|obj|const|ref):(?:`|<code>)")


class _Page(HTMLParser):
    """The links (href, src) and the ids of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("href", "src") and value is not None:
                self.links.append(value)
            elif name == "id" and value:
                self.ids.add(value)


def parse(page: Path) -> _Page:
    parsed = _Page()
    parsed.feed(page.read_text())
    return parsed


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = os.environ.get("TITAN_REFERENCE_PAGES")
    if built:
        return Path(built).parent / "site"
    tmp = tmp_path_factory.mktemp("reference")
    gen_reference.generate(tmp / "src")
    config = (gen_reference.DOCS / "mkdocs.yml").read_text()
    config = config.replace("docs_dir: _build/src", f"docs_dir: {tmp / 'src'}")
    config = config.replace("site_dir: _build/site", f"site_dir: {tmp / 'site'}")
    config = config.replace("- ../packages/", f"- {gen_reference.ROOT}/packages/")
    for local in ("hooks.py", "griffe_roles.py"):
        config = config.replace(f"- {local}", f"- {gen_reference.DOCS / local}")
    (tmp / "mkdocs.yml").write_text(config)
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp / "mkdocs.yml")]
    subprocess.run(cmd, check=True, capture_output=True)
    return tmp / "site"


@pytest.fixture(scope="module")
def pages(site: Path) -> dict[Path, _Page]:
    # (404.html is served only, by a server, and has root-relative links by design)
    found = {page: parse(page) for page in sorted(site.rglob("*.html")) if page.name != "404.html"}
    assert len(found) > 20, site  # the reference pages, a page per group of objects
    return found


def test_every_link_opens_a_file_from_disk(site: Path, pages: dict[Path, _Page]) -> None:
    """Opened as file://, a link to a folder shows a listing: every internal link must name
    a file that exists, and its #anchor an id on that page."""
    broken = []
    for page, parsed in pages.items():
        for link in parsed.links:
            url = urlsplit(link)
            if url.scheme or url.netloc or link.startswith(("mailto:", "data:")):
                continue
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {link}")
            elif url.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if unquote(url.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    assert not broken, f"{len(broken)} broken links, e.g. {broken[:10]}"


def test_no_sphinx_role_is_shown_as_text(site: Path, pages: dict[Path, _Page]) -> None:
    shown = [
        f"{page.relative_to(site)}: {found.group(0)}"
        for page in pages
        for found in ROLE.finditer(page.read_text())
    ]
    assert not shown, shown
    # and the roles became links: :meth:`step` in Pipeline's docstring
    parallel = (site / "packages" / "titan-models" / "titan_models.parallel.html").read_text()
    assert re.search(r'href="#titan_models\.Pipeline\.step"', parallel)


def test_the_site_needs_no_network_and_searches_offline(
    site: Path, pages: dict[Path, _Page]
) -> None:
    for page in pages:
        html = page.read_text()
        # scripts, stylesheets and fonts are local (links to GitHub are fine)
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(?:https?:)?//[^"]+"', html)
        assert not remote, (page, remote)
        # no "edit this page" link to a file that does not exist (the pages are generated)
        assert not re.search(r'href="https://github\.com/[^"]*(?:/edit/|_build)', html), page
    # search from file://: the index as a script (no XHR, which file:// forbids) and the
    # worker in an iframe (docs/assets/iframe-worker.js; docs-look checks it in a browser)
    assert (site / "search" / "search_index.js").read_text().startswith("var __index = {")
    assert 'src="assets/iframe-worker.js"' in (site / "index.html").read_text()
    # code is highlighted at build time (pygments), not in the browser
    cli = (site / "cli.html").read_text()
    assert 'class="highlight"' in cli
    assert '<span class="c1"># train the Llama 3 debug model' in cli


def test_types_in_tables_show_no_backslash(site: Path) -> None:
    config = (site / "config.html").read_text()
    assert "\\|" not in config
    assert "<code>str &#124; None</code>" in config  # an HTML entity: shown as |, not a cell end
