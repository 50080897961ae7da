#!/usr/bin/env bash
# Fill .whl/ with what tools/gpu_smoke.sh needs on an offline GPU node that has Python 3.12
# and torch but not titan-train's pure-Python dependencies tyro (with docstring-parser and
# typeguard; typing-extensions comes with torch). Run where pip reaches an index, then bring
# .whl/ (git-ignored) along with the checkout.
#   bash tools/gpu_wheels.sh [PYTHON_VERSION]        # default 3.12, the node's python3
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)
mkdir -p .whl
for wheel in "${WHEELS[@]}"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${1:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 -d .whl "$wheel"
done
ls .whl
