#!/usr/bin/env bash
# Install kv-chunk-fs for running (README's first command), on Debian 12+ or Ubuntu:
# - the system packages the filesystem needs (scripts/lib.sh: RUNTIME_PKGS), with apt as
#   root (without root it names the missing ones and stops);
# - the package with its runtime dependencies, at the versions requirements.lock pins, into a virtual
#   environment of its own: /opt/kv-chunk-fs as root, else ${XDG_DATA_HOME:-~/.local/share}/kv-chunk-fs-venv
#   (kv-chunk-fs there is the default store). The system's Python stays untouched (PEP 668);
# - the command on PATH: a symlink /usr/local/bin/kv-chunk-fs as root, else ~/.local/bin/kv-chunk-fs.
# Running it again upgrades in place; restart a running daemon afterwards. Nothing test-only is
# installed (scripts/setup-dev.sh adds that).
# Environment: PYTHON (the interpreter; default: the first Python >= 3.11 on PATH; the venv is made
# again when it was made with another one), KVCFS_VENV, KVCFS_BINDIR (the places above), KVCFS_EXTRAS=s3
# (the shared S3 tier).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
umask 022 # the venv readable by the users who run the command, writable by its owner only

install_places
py=$(find_python)
pyneed=$(python_packages "$py")
read -ra pypkgs <<<"$pyneed"
ensure_packages "${RUNTIME_PKGS[@]}" "${pypkgs[@]}"
if ! err=$("$py" -c 'import ensurepip, venv' 2>&1); then
    die "$py still cannot make a virtual environment: ${err##*$'\n'}"
fi
make_venv "$venv" "$py"

# The package is built from a clean copy of the source: an in-tree build would leave root-owned files
# in the checkout and could pack modules that a stale build/ still holds. Constraint mode (-c): of
# the pins only the runtime dependencies get installed.
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
tar -c --exclude=__pycache__ --exclude='*.egg-info' pyproject.toml README.md LICENSE src | tar -x -C "$src"
spec=$src${KVCFS_EXTRAS:+[$KVCFS_EXTRAS]}
[ -x "$venv/bin/kv-chunk-fs" ] && upgrade=1 || upgrade=
say "installing kv-chunk-fs and its pinned dependencies into $venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -c requirements.lock "$spec"

mkdir -p "$bindir"
link=$bindir/kv-chunk-fs
if [ -e "$link" ] && [ ! -L "$link" ]; then
    die "$link exists and is not a symlink (an install with pip into a system Python?): remove it" \
        "and run this again, or set KVCFS_BINDIR"
fi
ln -sfn "$venv/bin/kv-chunk-fs" "$link"

version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("kv-chunk-fs"))')
say "installed kv-chunk-fs $version in $venv (Python $(py_version "$venv/bin/python")); the command: $link"
if [ -n "$upgrade" ]; then
    say "a daemon already running still runs the version before: restart it (systemctl restart kv-chunk-fs)"
fi
found=$(command -v kv-chunk-fs || true)
if [[ ":$PATH:" != *":$bindir:"* ]]; then
    say "note: $bindir is not on PATH: add it, or run $link"
elif [ "$(readlink -f "$found")" != "$(readlink -f "$link")" ]; then
    say "note: another kv-chunk-fs comes first on PATH: $found"
fi
if [ ! -c /dev/fuse ]; then
    say "warning: there is no /dev/fuse here, so mounting will fail: load the module (modprobe fuse);" \
        "in a container, start it with --device /dev/fuse --cap-add SYS_ADMIN"
elif [ ! -r /dev/fuse ] || [ ! -w /dev/fuse ]; then
    say "warning: you cannot open /dev/fuse, so mounting will fail: ask for access to it, or run as root"
fi
