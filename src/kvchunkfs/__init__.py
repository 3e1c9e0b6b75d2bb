"""kv-chunk-fs: a deduplicating FUSE filesystem for llama-server slot snapshots."""

__version__ = "0.1.0"
