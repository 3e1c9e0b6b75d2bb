"""End-to-end harness: real llama-server saving slot snapshots into a kv-chunk-fs mount.

See e2e/README.md. ``e2e.ggsq`` (synthetic state files) is also used by the default test suite.
"""
