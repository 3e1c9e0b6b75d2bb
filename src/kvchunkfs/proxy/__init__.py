"""``kv-chunk-fs proxy``: llama-server's API with a disk prompt cache on the mount. A client of
llama-server and of the daemon's API; it reaches the store only through the API and the mount.
``server`` is the proxy, ``inputs`` the limits every request is checked against first."""
