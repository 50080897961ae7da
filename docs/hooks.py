"""mkdocs hook of the API reference: the navigation, which docs/gen_reference.py writes
next to the pages it generates (``.nav.json``; a page per group of objects, so it is not
known before the pages are)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def on_config(config: Any) -> Any:
    nav = Path(config["docs_dir"]) / ".nav.json"
    if nav.is_file():
        config["nav"] = json.loads(nav.read_text())
    return config
