"""OpenAPI 3.1 description of the HTTP API (served at ``GET /openapi.json``).

``docs/openapi.json`` is this, written by ``python -m kvchunkfs.service.openapi > docs/openapi.json``;
tests check the two agree, that every route of the app is described, and (schemathesis) that the
daemon accepts what the description accepts, refuses what it refuses and answers as it says.
"""

from __future__ import annotations

import json
from typing import Any

from kvchunkfs import __version__
from kvchunkfs.service.catalog import BYTE_FIELDS, MAX_COUNT, NUMERIC

_ERROR = {"$ref": "#/components/responses/Error"}
_UNAUTHORIZED = {"$ref": "#/components/responses/Unauthorized"}
_COUNT = {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}  # at most 18 digits
_BOOLEAN = {"type": "boolean"}  # true or false, nothing else (not empty)
_NO_NUL = "^[^\\u0000]*$"
LABEL_KEY_MAX = 200  # characters, and bytes of UTF-8 (routes.py): the xattr name must fit in 255
LABEL_VALUE_MAX = 1024
MAX_QUERY_TOKENS = 1 << 22  # far beyond any context window; bounds what one request can make us hold
INT32 = (-(1 << 31), (1 << 31) - 1)


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _query(name: str, description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema or {"type": "string"}}  # fmt: skip


_SNAPSHOT = {
    "type": "object",
    "required": ["path", "size", "chunks", "unique_bytes", "shared_bytes", "use_count", "created", "labels", "score"],
    "properties": {
        "path": {
            "type": "string",
            "description": "path relative to the mount, '/'-separated; bytes that are not UTF-8 are shown as U+FFFD",
        },
        "path_b64": {
            "type": "string",
            "description": "present if the path is not UTF-8: its exact bytes, base64 "
            "(percent-encode them in /snapshots/{path})",
        },
        "size": {"type": "integer", "description": "logical size in bytes"},
        "chunks": {"type": "integer", "description": "entries in the chunk index"},
        "distinct_chunks": {"type": "integer"},
        "unique_bytes": {"type": "integer", "description": "bytes of chunks no other snapshot names (freed by delete)"},
        "shared_bytes": {"type": "integer", "description": "bytes of chunks other snapshots name too"},
        "use_count": {"type": "integer", "description": "read-only opens (restores)"},
        "last_use": {"type": ["number", "null"], "description": "epoch seconds of the last restore"},
        "created": {"type": "number", "description": "epoch seconds of the first save under this name"},
        "age_hours": {"type": "number"},
        "idle_hours": {"type": "number", "description": "hours since last use (or creation)"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "score": {"type": "number", "description": "value of the configured score formula; lowest is evicted first"},
        "error": {"type": "string", "description": "present if the stub is not a readable index"},
        "broken": {
            "type": "string",
            "description": "present if `fsck --repair` marked the snapshot broken (it cannot be read in full): why",
        },
        "where": {
            "type": "string",
            "enum": ["local", "both", "remote"],
            "description": "with a remote only: 'both' if the bucket has it too, 'remote' if some "
            "chunks are only in the bucket (evicted or not fetched yet), 'local' if not (yet)",
        },
    },
}

_FIELDS = ("path, size, chunks, distinct_chunks, unique_bytes, shared_bytes, use_count, last_use, created, "
           "age_hours, idle_hours, score, label.<key>")  # fmt: skip

_SORT = {"type": "string", "pattern": f"^-?(path|{'|'.join(NUMERIC)}|label\\..+)$"}
_NUMBER = "^ *[+-]?([0-9]+(\\.[0-9]*)?|\\.[0-9]+)([eE][+-]?[0-9]+)? *$"
_SIZE = "^ *([0-9]+(\\.[0-9]*)?|\\.[0-9]+) *([kKmMgGtT]([iI]?[bB])?|[bB])? *$"
_FILTERS = {
    "name": "filters",
    "in": "query",
    "required": False,
    "style": "form",
    "explode": True,
    "description": "label.<key>=VALUE: only snapshots whose label <key> equals VALUE; min_<field>=N and "
    "max_<field>=N: bounds of a numeric field (sizes take units: 1MiB, 2GB)",
    "schema": {
        "type": "object",
        "patternProperties": {
            "^label\\..+$": {"type": "string"},
            f"^(min|max)_({'|'.join(sorted(BYTE_FIELDS))})$": {"type": "string", "pattern": _SIZE},
            f"^(min|max)_({'|'.join(f for f in NUMERIC if f not in BYTE_FIELDS)})$": {
                "type": "string",
                "pattern": _NUMBER,
            },
        },
        "additionalProperties": False,
    },
}

_PATHS: dict[str, Any] = {
    "/snapshots": {
        "get": {
            "summary": "List snapshots with sizes, unique/shared bytes, metadata and score",
            "parameters": [
                _query("sort", f"field to sort by, '-' prefix for descending: {_FIELDS}", _SORT),
                _query("order", "asc (default) or desc", {"type": "string", "enum": ["asc", "desc"]}),
                _query("prefix", "only paths starting with this"),
                _FILTERS,
                _query("has_label", "only snapshots that have this label"),
                _query("limit", "at most this many rows", _COUNT),
                _query("offset", "skip this many rows (after filtering and sorting): a page of any order", _COUNT),
                _query("after", "only rows after this path (with sort=path only, else 400): the next page"),
            ],
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "count": {"type": "integer"},
                            "total": {"type": "integer", "description": "rows the filters match, before limit/offset"},
                            "next": {"type": "string", "description": "after= of the next page (a full page only)"},
                            "snapshots": {"type": "array", "items": {"$ref": "#/components/schemas/Snapshot"}},
                            "remote_only": {
                                "type": "array",
                                "items": {"type": "string"},
                                "description": "with a remote only: the bucket's snapshots (under prefix) "
                                "this host has no stub of",
                            },
                        },
                    }
                ),  # fmt: skip
                "400": _ERROR,
            },
        }
    },
    "/snapshots/{path}": {
        "parameters": [
            {
                "name": "path",
                "in": "path",
                "required": True,
                "schema": {"type": "string"},
                "description": "snapshot path relative to the mount, percent-encoded bytes (a name "
                "that is not UTF-8 too: see path_b64); no '..', no symlinks",
            }
        ],  # fmt: skip
        "get": {
            "summary": "One snapshot",
            "responses": {"200": _json({"$ref": "#/components/schemas/Snapshot"}), "400": _ERROR, "404": _ERROR},
        },
        "delete": {
            "summary": "Delete a snapshot (unlinked through the mount; GC frees its unique chunks)",
            "responses": {
                "200": _json(
                    {"type": "object", "properties": {"deleted": {"type": "string"}, "path_b64": {"type": "string"}}}
                ),
                "400": _ERROR,
                "403": _ERROR,
                "404": _ERROR,
                "409": _ERROR,
            },  # fmt: skip
        },
        "patch": {
            "summary": "Set or remove labels (xattrs user.kvcfs.label.KEY, set through the mount)",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["labels"],
                            "additionalProperties": False,
                            "properties": {
                                "labels": {
                                    "type": "object",
                                    "propertyNames": {"minLength": 1, "maxLength": LABEL_KEY_MAX, "pattern": _NO_NUL},
                                    "additionalProperties": {
                                        "type": ["string", "null"],
                                        "maxLength": LABEL_VALUE_MAX,
                                        "pattern": _NO_NUL,
                                    },
                                    "description": "KEY: VALUE sets a label, KEY: null removes it. A key has at "
                                    f"most {LABEL_KEY_MAX} bytes of UTF-8; labels that do not fit in the "
                                    "snapshot's attribute space (one 4 KiB block on ext4) are a 413",
                                }
                            },
                        }
                    }
                },
            },
            "responses": {
                "200": _json({"$ref": "#/components/schemas/Snapshot"}),
                "400": _ERROR,
                "403": _ERROR,
                "404": _ERROR,
                "409": _ERROR,
                "413": _ERROR,
                "507": _ERROR,
            },
        },  # fmt: skip
    },
    "/deletion-preview": {
        "post": {
            "summary": "What deleting these snapshots together would free (at the next GC)",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["paths"],
                            "additionalProperties": False,
                            "properties": {"paths": {"type": "array", "items": {"type": "string"}}},
                        }
                    }
                },
            },
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "snapshots": {"type": "integer", "description": "paths found"},
                            "freed_bytes": {
                                "type": "integer",
                                "description": "bytes of chunks only these snapshots name",
                            },
                            "freed_chunks": {"type": "integer"},
                            "missing": {"type": "array", "items": {"type": "string"}},
                        },
                    }
                ),
                "400": _ERROR,
                "413": _ERROR,
            },
        }  # fmt: skip
    },
    "/history": {
        "get": {
            "summary": "Saves, restores and GC runs since the daemon started (bounded, in memory), as columns",
            "parameters": [_query("since", "only events after this time (epoch seconds)", {"type": "number"})],
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "started": {"type": "number"},
                            "capacity": {"type": "integer", "description": "events kept per kind"},
                            "saves": {
                                "type": "object",
                                "description": "time, seconds (save time: until stored), size, new_bytes, store_bytes, "
                                "close_seconds (close time): lists",
                            },
                            "restores": {"type": "object", "description": "time, seconds, size: lists"},
                            "gc": {"type": "object", "description": "time, seconds, bytes_freed, store_bytes: lists"},
                            "latency": {
                                "type": "object",
                                "description": "save / close / restore: count, p50, p90, p99 (seconds)",
                            },
                        },
                    }
                ),
                "400": _ERROR,
            },
        }  # fmt: skip
    },
    "/stats": {
        "get": {
            "summary": "Store totals and filesystem counters",
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "snapshots": {"type": "integer"},
                            "logical_bytes": {"type": "integer"},
                            "referenced_bytes": {"type": "integer"},
                            "stored_bytes": {"type": "integer"},
                            "pack_bytes": {"type": "integer"},
                            "chunks": {"type": "integer"},
                            "packs": {"type": "integer"},
                            "dedup_ratio": {"type": "number"},
                            "broken": {"type": "integer"},
                            "counters": {"type": "object", "additionalProperties": {"type": "integer"}},
                            "gc": {
                                "type": "object",
                                "properties": {
                                    "runs": {"type": "integer"},
                                    "last": {"type": ["object", "null"]},
                                    "idle_skips": {
                                        "type": "integer",
                                        "description": "timer runs skipped: the store was unchanged",
                                    },
                                    "interval_s": {"type": "integer"},
                                    "last_finished": {"type": ["number", "null"], "description": "epoch seconds"},
                                    "next_due": {
                                        "type": ["number", "null"],
                                        "description": "epoch seconds of the next periodic run",
                                    },
                                },
                            },
                            "remote": {
                                "type": "object",
                                "description": "with a remote only: the bucket as last listed",
                                "properties": {
                                    "url": {"type": "string"},
                                    "snapshots": {"type": "integer"},
                                    "index_bytes": {"type": "integer"},
                                },
                            },
                        },
                    }
                )
            },  # fmt: skip
        }
    },
    "/gc": {
        "post": {
            "summary": "Run garbage collection now and return its report",
            "parameters": [
                _query("walk", "true: read every stub; false (default): what changed since the last run", _BOOLEAN),
                _query("dry_run", "true: report what a walk would free, delete nothing", _BOOLEAN),
            ],
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "description": "the collector's report (GCReport)",
                        "properties": {
                            "chunks_freed": {"type": "integer"},
                            "bytes_freed": {"type": "integer", "description": "chunk bytes dropped from the map"},
                            "disk_bytes_freed": {"type": "integer", "description": "pack file bytes given back"},
                            "packs_deleted": {"type": "integer"},
                            "packs_compacted": {"type": "integer"},
                            "errors": {"type": "array", "items": {"type": "string"}},
                            "duration_s": {"type": "number"},
                            "dry_run": {"type": "boolean", "description": "true: figures of a run, nothing deleted"},
                        },
                    }
                ),
                "400": _ERROR,
                "503": _ERROR,
            },  # fmt: skip
        }
    },
    "/logs": {
        "get": {
            "summary": "Recent log lines of the daemon (in-memory ring buffer)",
            "parameters": [
                _query(
                    "level",
                    "minimum level",
                    {"type": "string", "enum": ["debug", "info", "warning", "error", "critical"]},
                ),
                _query("limit", "newest this many lines (default 200; the buffer keeps 2000)", _COUNT),
            ],  # fmt: skip
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "count": {"type": "integer"},
                            "lines": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "time": {"type": "number"},
                                        "level": {"type": "string"},
                                        "logger": {"type": "string"},
                                        "message": {"type": "string"},
                                    },
                                },
                            },
                        },
                    }
                ),  # fmt: skip
                "400": _ERROR,
                "503": _ERROR,
            },
        }
    },
    "/metrics": {
        "get": {
            "summary": "Prometheus metrics (text exposition format)",
            "responses": {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}},
        }
    },
    "/prefix-tree": {
        "get": {
            "summary": "Token-prefix tree of the snapshots (llama-server ggsq files)",
            "parameters": [
                _query("prefix", "only snapshot paths starting with this"),
                _query("format", "json (default) or text", {"type": "string", "enum": ["json", "text"]}),
                _query(
                    "shared_by",
                    "true: every node also lists the names of all snapshots below it "
                    "(N x depth names; by default each name appears once, in ends_here)",
                    _BOOLEAN,
                ),
            ],
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "snapshots": {"type": "integer"},
                                    "skipped": {"type": "array", "items": {"type": "object"}},
                                    "tree": {"$ref": "#/components/schemas/TreeNode"},
                                },
                            }
                        },  # fmt: skip
                        "text/plain": {"schema": {"type": "string"}},
                    },
                },
                "400": _ERROR,
            },
        }
    },
    "/prefix-match": {
        "post": {
            "summary": "Snapshots sharing the longest token prefix with the given tokens (the proxy's lookup)",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["tokens"],
                            "additionalProperties": False,
                            "properties": {
                                "tokens": {
                                    "type": "array",
                                    "maxItems": MAX_QUERY_TOKENS,
                                    "items": {"type": "integer", "minimum": INT32[0], "maximum": INT32[1]},
                                },
                                "prefix": {"type": "string", "description": "only snapshot paths starting with this"},
                                "exclude_suffix": {
                                    "type": "string",
                                    "description": "skip paths ending with this (e.g. .tmp)",
                                },
                                "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 1},
                            },
                        }
                    }
                },
            },  # fmt: skip
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "count": {"type": "integer"},
                            "matches": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "path": {"type": "string"},
                                        "path_b64": {"type": "string"},
                                        "match": {
                                            "type": "integer",
                                            "description": "leading tokens shared with the query",
                                        },
                                        "tokens": {"type": "integer", "description": "the snapshot's own token count"},
                                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    }
                ),  # fmt: skip
                "400": _ERROR,
            },
        }
    },
    "/openapi.json": {"get": {"summary": "This description", "responses": {"200": _json({"type": "object"})}}},
    "/health": {
        "get": {
            "summary": "Liveness (no token needed)",
            "security": [],
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "status": {"type": "string", "enum": ["ok", "degraded"]},
                            "filesystem": {"type": "boolean"},
                            "unstored_saves": {"type": "integer", "description": "saves held only in memory"},
                            "unstored_bytes": {"type": "integer"},
                        },
                    }
                )
            },
        }
    },
}

_TREE_NODE = {
    "type": "object",
    "properties": {
        "prefix_tokens": {"type": "integer", "description": "prefix length at the end of this node's edge"},
        "edge_tokens": {"type": "integer"},
        "shared_count": {"type": "integer", "description": "snapshots whose tokens pass through or end here"},
        "shared_by": {"type": "array", "items": {"type": "string"}, "description": "only with ?shared_by=true"},
        "ends_here": {"type": "array", "items": {"type": "string"}, "description": "snapshots ending here"},
        "first_tokens": {"type": "array", "items": {"type": "integer"}},
        "children": {"type": "array", "items": {"$ref": "#/components/schemas/TreeNode"}},
    },
}


def _with_401(paths: dict[str, Any]) -> dict[str, Any]:
    """Every operation that needs the token (all but those with ``security: []``) may answer 401."""
    out: dict[str, Any] = {}
    for path, item in paths.items():
        out[path] = {}
        for method, op in item.items():
            if isinstance(op, dict) and "responses" in op and op.get("security") != []:
                op = {**op, "responses": {**op["responses"], "401": _UNAUTHORIZED}}
            out[path][method] = op
    return out


def spec() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kv-chunk-fs",
            "version": __version__,
            "description": "API of a kv-chunk-fs daemon. TCP (api_address) needs the bearer token api_token "
            "when one is set; the unix socket STORE/api.sock (mode 0600) needs none.",
        },
        "servers": [{"url": "http://127.0.0.1:8765"}],
        "security": [{"bearer": []}],
        "paths": _with_401(_PATHS),
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Snapshot": _SNAPSHOT, "TreeNode": _TREE_NODE},
            "responses": {
                "Error": _json(
                    {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
                    "error with a message",
                ),
                "Unauthorized": {
                    **_json(
                        {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
                        "TCP only: missing or wrong bearer token",
                    ),
                    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}, "required": True}},
                },
            },
        },
    }


if __name__ == "__main__":
    print(json.dumps(spec(), indent=2))
