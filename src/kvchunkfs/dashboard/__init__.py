"""``kv-chunk-fs ui``: the operator dashboard, a process of its own that serves ``ui/`` and passes the
endpoints its pages use to the daemon's unix socket. Never imported by the daemon."""
