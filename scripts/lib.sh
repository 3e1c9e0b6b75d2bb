# shellcheck shell=bash disable=SC2034 # the names set here are used by the scripts that source it
# Shared by scripts/setup.sh (install for running) and scripts/setup-dev.sh (tests and development):
# the system packages, the choice of Python, the virtual environment. Sourced, not run.

# What the filesystem needs at run time: fusermount3 (and libfuse3, which it pulls in).
RUNTIME_PKGS=(fuse3)
# Only for the tests: make (the tiers), casync (interop tests), attr (setfattr in the security tests),
# Chromium and its driver (the dashboard's browser tests).
TEST_PKGS=(make casync attr chromium chromium-driver)

say() { echo "kv-chunk-fs setup: $*" >&2; }
die() {
    say "$*"
    exit 1
}

# Where scripts/setup.sh installs: sets venv and bindir.
install_places() {
    if [ "$(id -u)" -eq 0 ]; then
        venv=${KVCFS_VENV:-/opt/kv-chunk-fs}
        bindir=${KVCFS_BINDIR:-/usr/local/bin}
    else # ~/.local/share/kv-chunk-fs is the default store
        venv=${KVCFS_VENV:-${XDG_DATA_HOME:-$HOME/.local/share}/kv-chunk-fs-venv}
        bindir=${KVCFS_BINDIR:-$HOME/.local/bin}
    fi
}

py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
py_real() { "$1" -c 'import os, sys; print(os.path.realpath(sys.executable))'; }
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

# The interpreter to make a virtual environment with: $PYTHON if set, else the first of python3,
# python3.14 ... python3.11 on PATH that is 3.11 or newer.
find_python() {
    local cand found=""
    if [ -n "${PYTHON:-}" ]; then
        py_ok "$PYTHON" || die "PYTHON=$PYTHON is $(py_version "$PYTHON" || echo 'not a runnable Python');" \
            "kv-chunk-fs needs Python 3.11 or newer"
        command -v "$PYTHON"
        return
    fi
    for cand in python3 python3.14 python3.13 python3.12 python3.11; do
        command -v "$cand" >/dev/null || continue
        if py_ok "$cand"; then
            command -v "$cand"
            return
        fi
        found+=" $(command -v "$cand") is $(py_version "$cand" || echo '?');"
    done
    die "kv-chunk-fs needs Python 3.11 or newer;${found:- there is no python3 on PATH;}" \
        "install one (Debian/Ubuntu: apt-get install python3.11 python3.11-venv) or name it:" \
        "PYTHON=/path/to/python3.11 bash $0"
}

# The Debian package name stem of an interpreter (python3.11), empty if no Debian package owns it.
debian_python() {
    local exe
    exe=$(py_real "$1") || return 0
    if command -v dpkg-query >/dev/null && dpkg-query -S "$exe" >/dev/null 2>&1; then
        echo "python$(py_version "$1")"
    fi
}

# The system packages the interpreter $1 lacks to make a virtual environment (Debian splits ensurepip
# into python3.X-venv). Printed on one line; dies when the interpreter is not Debian's and lacks them.
python_packages() {
    local py=$1 deb need=()
    deb=$(debian_python "$py")
    if ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
        [ -n "$deb" ] || die "$py cannot make a virtual environment (no ensurepip module): use a Python" \
            "built with it, or PYTHON=/usr/bin/python3"
        need+=("$deb-venv")
    fi
    echo "${need[*]}"
}

missing_packages() {
    local pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q '^install ok installed$' || echo "$pkg"
    done
}

# Installs the packages named that are missing (apt, as root); without root, names them and stops.
ensure_packages() {
    local need
    if ! command -v dpkg-query >/dev/null; then
        say "not a Debian/Ubuntu system: make sure these (Debian names) are installed: $*"
        return
    fi
    mapfile -t need < <(missing_packages "$@")
    [ ${#need[@]} -gt 0 ] || return 0
    [ "$(id -u)" -eq 0 ] || die "missing system packages: ${need[*]}. Install them" \
        "(sudo apt-get install ${need[*]}) or run this script as root."
    say "installing ${need[*]} (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
}

# The base interpreter of the working virtual environment $1; nothing if there is none.
venv_base() {
    "$1/bin/python" -c 'import os, sys; print(os.path.realpath(sys._base_executable))' 2>/dev/null || true
}

# Makes the virtual environment $1 with the interpreter $2 unless one is there that works and was made
# with it: that one is kept, and pip upgrades it in place.
make_venv() {
    local venv=$1 py=$2
    if [ -n "$(ls -A "$venv" 2>/dev/null)" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
        die "$venv exists and is not a virtual environment: move it away, or choose another place"
    fi
    if [ "$(venv_base "$venv")" != "$(py_real "$py")" ] \
        || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
        say "making the virtual environment $venv with $py (Python $(py_version "$py"))"
        mkdir -p "$(dirname "$venv")"
        "$py" -m venv --clear "$venv"
    fi
}
