"""Look at the built API reference in a real browser, opened from disk as a user opens it.

    python docs/look.py [--site docs/_build/site] [--out docs/_build/look]

Takes a screenshot of each kind of page (overview, a package, a page of titan-models'
objects, the configuration, the commands) with headless Chromium, and runs a search from
file:// (``index.html?q=checkpoint``), failing when it finds nothing. A developer's check
(`hatch run docs-look`), not CI's: installing Chromium alone takes over a minute. Needs
``chromium`` on PATH (Debian: ``apt-get install chromium``). Then look at the PNGs.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
PAGES = {
    "index": "index.html",
    "package": "packages/titan-ckpt/index.html",
    "models": "packages/titan-models/titan_models.llama3.html",
    "config": "config.html",
    "commands": "cli.html",
}


def chromium(*args: str) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("error: chromium is not on PATH; install it (apt-get install chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    done = subprocess.run(
        [exe, *flags, *args], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=DOCS / "_build" / "site")
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "look")
    args = parser.parse_args(argv)
    site = args.site.resolve()
    if not (site / "index.html").is_file():
        raise SystemExit(f"error: no site at {site}; build it first with `hatch run docs`")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, page in PAGES.items():
        png = args.out.resolve() / f"{name}.png"
        chromium(f"--screenshot={png}", "--window-size=1280,1600", (site / page).as_uri())
        print(f"{name:9} {png}")
    dom = chromium(
        "--dump-dom", "--virtual-time-budget=10000", f"{site.as_uri()}/index.html?q=checkpoint"
    )
    found = re.search(r'md-search-result__meta">([^<]*)<', dom)
    print(f"search    'checkpoint' from file://: {found.group(1) if found else 'no results'}")
    return 0 if found and found.group(1)[:1].isdigit() else 1


if __name__ == "__main__":
    sys.exit(main())
