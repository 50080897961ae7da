"""Build, check, tag and publish the titan packages; rehearse a whole release locally.

    python tools/release/release.py prepare PKG VERSION   # date the changelog, set the version
    python tools/release/release.py build   [--out DIST] [PKG ...]
    python tools/release/release.py check   [--out DIST] [PKG ...]
    python tools/release/release.py tag     [--dry-run] [PKG ...]
    python tools/release/release.py publish --index DIR | --repository-url URL [PKG ...]
    python tools/release/release.py rehearse [--out DIR] [--smoke all|quick]

``build`` writes a wheel and an sdist per package (``python -m build``, hatchling in an
isolated environment); ``check`` runs ``twine check``, ``check-wheel-contents`` and our own
rules (py.typed, LICENSE, README, entry points, no tests in the wheel, sibling ranges in the
metadata); ``tag`` creates ``titan-<name>-v<version>`` (refusing a version the changelog has
not dated, or a tag already pointing elsewhere); ``publish`` copies the files into a PEP 503
"simple" folder (``--index``) or uploads them with twine (``--repository-url``).
``rehearse`` does all of it against a local index in a temporary folder (the tag dry-run),
then installs each package by name into a fresh venv holding only torch and runs the smoke
scripts in ``tools/release/smoke``. See RELEASING.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from artifacts import build, check_dists, publish_folder, publish_twine
from common import PACKAGES, ROOT, packages
from packaging.version import Version
from prepare import prepare
from rehearsal import rehearse
from tagging import tag


def _chosen(names: list[str]) -> list:
    unknown = sorted(set(names) - set(PACKAGES))
    if unknown:
        raise SystemExit(f"error: unknown package(s) {unknown}; choose from {list(PACKAGES)}")
    return [pkg for pkg in packages(ROOT) if not names or pkg.name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "check", "tag", "publish"):
        cmd = sub.add_parser(name)
        cmd.add_argument("packages", nargs="*", metavar="PKG", help="default: all five")
        cmd.add_argument("--out", type=Path, default=ROOT / "dist", help="dist folder")
    sub.choices["tag"].add_argument("--dry-run", action="store_true", help="only print")
    pub = sub.choices["publish"]
    pub.add_argument("--index", type=Path, help="a PEP 503 simple folder to publish into")
    pub.add_argument("--repository-url", help="an index to upload to with twine")
    prep = sub.add_parser("prepare", help="date the changelog's notes and set the version")
    prep.add_argument("package", choices=PACKAGES)
    prep.add_argument("version", type=Version)
    reh = sub.add_parser("rehearse")
    reh.add_argument("--out", type=Path, help="work folder (default: a new temporary one)")
    reh.add_argument(
        "--smoke",
        choices=["all", "quick"],
        default="all",
        help="quick: titan-dims and titan-ckpt smokes only (all five still build and install)",
    )
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(_chosen([args.package])[0], args.version)
        return 0
    if args.command == "rehearse":
        return rehearse(packages(ROOT), args.out, quick=args.smoke == "quick")
    chosen = _chosen(args.packages)
    if args.command == "build":
        build(chosen, args.out)
        return 0
    if args.command == "check":
        return check_dists(chosen, args.out)
    if args.command == "tag":
        return tag(chosen, ROOT, dry_run=args.dry_run)
    if (args.index is None) == (args.repository_url is None):
        parser.error("publish needs exactly one of --index DIR or --repository-url URL")
    if args.index is not None:
        publish_folder(chosen, args.out, args.index)
        return 0
    return publish_twine(chosen, args.out, args.repository_url)


if __name__ == "__main__":
    sys.exit(main())
