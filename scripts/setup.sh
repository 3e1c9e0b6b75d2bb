#!/usr/bin/env bash
# Install what kv-chunk-fs needs on a fresh Debian 12 machine (run as root): FUSE 3 and its
# headers (pyfuse3 builds from source), casync for the interop test, chromium + its driver for the
# dashboard's browser tests, then the pinned Python dependencies and the package itself.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
for pkg in fuse3 make casync attr chromium chromium-driver; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
# The dependencies at the versions pinned in requirements.lock (`make lock`), then the package
# itself without resolving its dependencies again.
python3 -m pip install -q --disable-pip-version-check -r requirements.lock
python3 -m pip install -q --disable-pip-version-check --no-deps -e .
