"""CLI commands that inspect a store: ``ls``, ``stats``, ``tree``.

Each asks the running daemon over ``STORE/api.sock`` when there is one (its view includes open files
and live counters) and otherwise reads the store directory itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvchunkfs import config as cfgmod
from kvchunkfs.cli.common import open_repo, operator_error
from kvchunkfs.file.files import Files
from kvchunkfs.formula import compile_formula
from kvchunkfs.service import catalog, prefixtree
from kvchunkfs.service.apiclient import DaemonClient, DaemonError, running_daemon
from kvchunkfs.units import format_duration, format_size


class CliError(RuntimeError):
    """A user-facing failure: printed as one line, exit status 2."""


def _store(cfg: cfgmod.Config) -> Path:
    store = Path(cfg.store)
    if not (store / "snapshots").is_dir():
        raise CliError(f"no store at {store}: set --store or KV_CHUNK_FS_STORE (`kv-chunk-fs mount` creates one)")
    return store


def _filters(items: list[str]) -> dict[str, str]:
    """``--filter KEY=VALUE`` options as query parameters."""
    params: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--filter {item!r}: use KEY=VALUE, e.g. label.model=qwen or min_size=1MiB")
        params[key] = value
    return params


def _run(fn: Any, cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    try:
        return fn(cfg, args)
    except (CliError, catalog.QueryError) as e:
        print(f"kv-chunk-fs: {e}", file=sys.stderr)
        return 2
    except DaemonError as e:  # a request the daemon refused (a bad filter) is the caller's to fix
        print(f"kv-chunk-fs: {e.message}", file=sys.stderr)
        return 2 if 400 <= e.status < 500 else 1
    except OSError as e:  # e.g. a store readable only by the user the daemon runs as
        print(f"kv-chunk-fs: {operator_error(e)}", file=sys.stderr)
        return 2


# -- ls --------------------------------------------------------------------------------------------


def snapshot_rows(cfg: cfgmod.Config, params: dict[str, str]) -> list[dict[str, Any]]:
    store = _store(cfg)
    client = running_daemon(store)
    if client is not None:
        answer = client.json("GET", "/snapshots", params)
        return answer["snapshots"] + [_remote_row(rel) for rel in answer.get("remote_only", [])]
    rows = catalog.snapshots(store / "snapshots", compile_formula(cfg.score))
    return [r.to_dict() for r in catalog.select(rows, params)]


def _remote_row(rel: str) -> dict[str, Any]:
    """A snapshot only the bucket holds: its numbers are unknown until a host fetches its index."""
    return {"path": rel, "where": "remote", "size": None, "unique_bytes": None, "shared_bytes": None,
            "use_count": 0, "last_use": None, "score": None, "labels": {}}  # fmt: skip


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return format_size(n).replace(" ", "")


def _ago(epoch: float | None, now: float) -> str:
    if not epoch:
        return "never"
    return format_duration(max(0, int(now - epoch))) + " ago"


def render_table(rows: list[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    where = any("where" in r for r in rows)  # a remote is configured: say where each snapshot is
    table: list[list[str]] = [["PATH", "SIZE", "UNIQUE", "SHARED", "USES", "LAST USE", "SCORE", "LABELS"]]
    for r in rows:
        labels = ",".join(f"{k}={v}" for k, v in r["labels"].items())
        path = r["path"] + (
            " (unreadable)" if r.get("error") else f" (broken: {r['broken']})" if r.get("broken") else ""
        )
        score = "-" if r["score"] is None else f"{r['score']:.4g}"
        table.append(
            [path, _size(r["size"]), _size(r["unique_bytes"]), _size(r["shared_bytes"]), str(r["use_count"]),
             _ago(r["last_use"], now), score, labels]
        )  # fmt: skip
    if where:
        for row, r in zip(table, [{"where": "WHERE"}, *rows], strict=True):
            row.insert(7, str(r.get("where", "local")))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    right = {1, 2, 3, 4, 6}  # numbers line up on the right
    lines = []
    for row in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def cmd_ls(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    def run(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
        params = _filters(args.filter)
        if args.sort:
            params["sort"] = args.sort
        if args.reverse:
            params["order"] = "desc"
        rows = snapshot_rows(cfg, params)
        sys.stdout.write(json.dumps(rows, indent=2) + "\n" if args.json else render_table(rows))
        broken = sum(1 for r in rows if r.get("broken") or r.get("error"))
        if broken and not args.json:
            print(f"kv-chunk-fs: {broken} snapshots cannot be read in full (opening them fails with EIO): "
                  "`kv-chunk-fs fsck` says what each problem means and what to do", file=sys.stderr)  # fmt: skip
        return 0

    return _run(run, cfg, args)


# -- stats -----------------------------------------------------------------------------------------


def store_stats(cfg: cfgmod.Config) -> dict[str, Any]:
    store = _store(cfg)
    client = running_daemon(store)
    if client is not None:
        return client.json("GET", "/stats")
    return catalog.store_totals(store).to_dict()


def render_stats(stats: dict[str, Any]) -> str:
    rows = [
        (
            "snapshots",
            str(stats["snapshots"]) + (f" ({stats['broken']} broken: see `ls`)" if stats.get("broken") else ""),
        ),
        ("logical bytes", _with_size(stats["logical_bytes"])),
        ("referenced bytes", _with_size(stats["referenced_bytes"])),
        ("stored bytes", _with_size(stats["stored_bytes"])),
        ("pack file bytes", _with_size(stats["pack_bytes"])),
        ("dedup ratio", f"{stats['dedup_ratio']:.2f}"),
        ("chunks", str(stats["chunks"])),
        ("packs", str(stats["packs"])),
    ]
    if "remote" in stats:
        rows.append(("remote", f"{stats['remote']['url']} ({stats['remote']['snapshots']} snapshots)"))
    if "fuse" in stats:  # a mounted store: how its files' bytes travel
        rows.append(("fuse mode", f"{stats['fuse']['mode']} ({stats['fuse']['why']})"))
    for name, value in sorted(stats.get("counters", {}).items()):
        rows.append((name.replace("_", " "), str(value)))
    width = max(len(name) for name, _ in rows)
    return "".join(f"{name + ':':<{width + 1}}  {value}\n" for name, value in rows)


def _with_size(n: int) -> str:
    return f"{n} ({format_size(n)})" if n >= 1024 else str(n)


def cmd_stats(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    def run(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
        stats = store_stats(cfg)
        sys.stdout.write(json.dumps(stats, indent=2) + "\n" if args.json else render_stats(stats))
        return 0

    return _run(run, cfg, args)


# -- tree ------------------------------------------------------------------------------------------


def tree_text(cfg: cfgmod.Config, prefix: str) -> str:
    store = _store(cfg)
    client: DaemonClient | None = running_daemon(store)
    if client is not None:
        return client.text("GET", "/prefix-tree", {"prefix": prefix, "format": "text"})
    repo = open_repo(cfg)  # no daemon: read the chunks ourselves
    files = Files(repo)
    try:
        root, skipped = catalog.token_tree(repo.snapshots, files.read_chunks, prefix)
    finally:
        files.close()
        repo.close()
    return prefixtree.render_text(root, skipped)


def cmd_tree(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    def run(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
        sys.stdout.write(tree_text(cfg, args.prefix))
        return 0

    return _run(run, cfg, args)


# -- wiring ----------------------------------------------------------------------------------------


def add_ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sort", metavar="FIELD", help="sort by FIELD (e.g. score, unique_bytes, label.model)")
    p.add_argument("-r", "--reverse", action="store_true", help="sort in descending order")
    p.add_argument(
        "--filter", metavar="KEY=VALUE", action="append", default=[],
        help="e.g. label.model=qwen, prefix=chat/, min_size=1MiB, max_score=0.5 (repeatable)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_tree_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default="", help="only snapshot paths starting with this")
