"""The proxy's own Prometheus metrics (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvcfs_proxy_requests", "Generation requests by what served their prompt "
                                "(restored: from the store; in_slot: already in the slot; evaluated: all of it "
                                "evaluated; uncached: not tokenizable)", ["outcome"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("kvcfs_proxy_prompt_tokens", "Prompt tokens by source (restored: from the "
                                     "store, in_slot: already in the slot, evaluated: by llama-server)", ["source"],
                                     registry=r)  # fmt: skip
        self.ttft = Histogram("kvcfs_proxy_time_to_first_token_seconds", "Request arrival to the first streamed "
                              "chunk (non-streaming: preparation + llama-server's prompt_ms)", ["restore"],
                              registry=r)  # fmt: skip
        self.restore_s = Histogram("kvcfs_proxy_restore_seconds", "Slot restores from the store", registry=r)
        self.save_s = Histogram("kvcfs_proxy_save_seconds", "Slot saves into the store (save + rename)", registry=r)
        self.refused = Counter("kvcfs_proxy_refused_requests", "Requests the proxy refused itself (413: body over "
                               "proxy_max_body; 400: not a JSON object, nested too deep, prompt over the token "
                               "limit)", ["status"], registry=r)  # fmt: skip
        self.errors = Counter("kvcfs_proxy_errors", "Failed steps (the request itself went on)", ["step"], registry=r)
        self.skipped = Counter("kvcfs_proxy_skipped_saves", "Saves not made (not_mounted: the directory is not on a "
                               "live kv-chunk-fs mount, so llama-server would write full files to the disk "
                               "under it)", ["reason"], registry=r)  # fmt: skip
        self.refused_restores = Counter("kvcfs_proxy_refused_restores", "Restores llama-server refused (refused: "
                                        "the file, not offered again until it changes; configuration: the server's "
                                        "KV layout had changed)", ["reason"], registry=r)  # fmt: skip
        self.evicted = Counter("kvcfs_proxy_evicted_snapshots", "Snapshots deleted for cache_max_bytes", registry=r)
        hit = Gauge(
            "kvcfs_proxy_prompt_hit_ratio", "Share of prompt tokens not evaluated (restored + in_slot)", registry=r
        )
        hit.set_function(self.hit_ratio)
        self._tokens = dict.fromkeys(
            ("restored", "in_slot", "evaluated"), 0
        )  # for the ratio, read without the registry

    def count_tokens(self, source: str, n: int) -> None:
        self._tokens[source] += n
        self.prompt_tokens.labels(source).inc(n)

    def hit_ratio(self) -> float:
        total = sum(self._tokens.values())
        return (self._tokens["restored"] + self._tokens["in_slot"]) / total if total else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
