"""kv-chunk-fs: a deduplicating FUSE filesystem for llama-server slot snapshots."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kv-chunk-fs")  # pyproject.toml's, as installed
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
