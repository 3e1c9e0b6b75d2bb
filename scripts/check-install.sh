#!/usr/bin/env bash
# Check what scripts/setup.sh installed (CI runs it right after, with only the system's python3 on
# PATH): the kv-chunk-fs on PATH is the symlink into the virtual environment, which was made with the
# Python setup picks (PYTHON, else the first python3 >= 3.11 on PATH), runs that environment's Python
# and package (not a checkout's), the interpreter the environment was made with did not get the package, and the command mounts a new store in a temporary directory, writes a file and reads it back,
# before and after a remount, and unmounts. Then install-systemd names the command in ExecStart.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
install_places
fail() {
    echo "check-install: FAILED: $*" >&2
    exit 1
}
ok() { echo "check-install: ok: $*" >&2; }

exe=$(command -v kv-chunk-fs) || fail "no kv-chunk-fs on PATH ($PATH)"
[ "$exe" = "$bindir/kv-chunk-fs" ] || fail "kv-chunk-fs on PATH is $exe, not $bindir/kv-chunk-fs"
[ "$(readlink -f "$exe")" = "$(readlink -f "$venv/bin/kv-chunk-fs")" ] || fail "$exe does not lead to $venv"
shebang=$(head -n1 "$venv/bin/kv-chunk-fs")
[[ $shebang == "#!$venv/bin/python"* ]] || fail "$venv/bin/kv-chunk-fs starts with $shebang"
"$venv/bin/python" -c 'import sys, kvchunkfs
assert kvchunkfs.__file__.startswith(sys.prefix + "/"), kvchunkfs.__file__' || fail "the package is not in $venv"
ok "$exe -> $(readlink -f "$exe"), $shebang, the package in $venv"
base=$(venv_base "$venv")
want=$(find_python)
[ "$base" = "$(py_real "$want")" ] || fail "$venv was made with $base, not with $want"
managed=$("$base" -c 'import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))')
if "$base" -I -c 'import importlib.metadata as m; m.distribution("kv-chunk-fs")' 2>/dev/null \
    || "$base" -I -c 'import kvchunkfs' 2>/dev/null; then
    fail "$base (which made $venv) has kv-chunk-fs installed: setup must install into the venv only"
fi
ok "$base (externally managed: $managed) has no kv-chunk-fs"

tmp=$(mktemp -d /tmp/kvcfs-check.XXXXXX)
pid=
cleanup() {
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        fusermount3 -u "$tmp/mnt" 2>/dev/null || true
        sleep 1
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
mkdir "$tmp/mnt"
head -c 3000000 /dev/urandom >"$tmp/data"

mount_store() { # starts the daemon, returns once the mount is up
    local _
    "$exe" mount --store "$tmp/store" "$tmp/mnt" >>"$tmp/daemon.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do
        mountpoint -q "$tmp/mnt" && return
        kill -0 "$pid" 2>/dev/null || fail "the daemon exited: $(cat "$tmp/daemon.log")"
        sleep 0.1
    done
    fail "not mounted after 60 s: $(cat "$tmp/daemon.log")"
}
unmount_store() { # and the daemon exits 0
    local rc=0
    fusermount3 -u "$tmp/mnt"
    timeout 60 tail --pid="$pid" -f /dev/null || fail "the daemon did not exit after the unmount"
    wait "$pid" || rc=$?
    pid=
    [ "$rc" -eq 0 ] || fail "the daemon exited with $rc: $(cat "$tmp/daemon.log")"
}

mount_store
cp "$tmp/data" "$tmp/mnt/file"
cmp "$tmp/data" "$tmp/mnt/file" || fail "read back differs"
unmount_store
[ ! -e "$tmp/mnt/file" ] || fail "the file is still there after the unmount"
mount_store
cmp "$tmp/data" "$tmp/mnt/file" || fail "read back after a remount differs"
unmount_store
ok "$exe mounted a store, wrote 3 MB and read them back, also after a remount, and unmounted"

"$exe" install-systemd --unit-dir "$tmp/units" >/dev/null
grep -qxF "ExecStart=$exe mount \${KVCFS_MOUNTPOINT}" "$tmp/units/kv-chunk-fs.service" \
    || fail "the unit's ExecStart: $(grep ExecStart= "$tmp/units/kv-chunk-fs.service")"
ok "install-systemd: ExecStart=$exe"
