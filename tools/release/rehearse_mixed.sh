#!/usr/bin/env bash
# Rehearse the mixed-version check before any real release exists: in a throwaway clone of
# this repository's HEAD, pretend every package was released as it is (tags
# titan-<name>-v<version>), make a patch release of titan-dims (its version and changelog,
# committed in the clone only), then run the rehearsal. It must install this tree's
# titan-models and titan-train with the "released" titan-dims (built from its tag) and pass
# their smoke scripts. About 6 minutes on 2 cores. Usage (dev environment):
#   hatch run rehearse-mixed [WORK_DIR]
set -euo pipefail
root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
work="${1:-$(mktemp -d /tmp/titan-mixed.XXXXXX)}"
rm -rf "$work/repo"
git clone -q "$root" "$work/repo"
cd "$work/repo"
py=python
for folder in packages/*/; do
  name="$(basename "$folder")"
  version="$($py -c "import sys; sys.path.insert(0, 'tools/release'); from common import Package; from pathlib import Path; print(Package('$name', Path('$folder')).version)")"
  git tag "$name-v$version"
done
dims="$($py -c "import sys; sys.path.insert(0, 'tools/release'); from common import packages; v = packages()[0].version; print(f'{v.major}.{v.minor}.{v.micro + 1}')")"
$py tools/release/release.py prepare titan-dims "$dims"
git -c user.name=rehearsal -c user.email=rehearsal@localhost commit -qam "titan-dims $dims (rehearsal only)"
$py tools/release/check_versions.py
$py tools/release/release.py rehearse --out "$work/out" --smoke quick | tee "$work/rehearsal.log"
grep -q "mixed-version install(s) passed" "$work/rehearsal.log"
grep -q "mix: titan-train .* with titan-dims" "$work/rehearsal.log"
