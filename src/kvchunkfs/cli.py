"""Command line: ``kv-chunk-fs mount|config|export-store|...``."""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from . import cliops
from . import config as cfgmod
from .repo import Repository, StoreSettings

if TYPE_CHECKING:
    from .gc import GarbageCollector

log = logging.getLogger("kvchunkfs")


def store_settings(cfg: cfgmod.Config) -> StoreSettings:
    return StoreSettings(
        chunk_min=cfg.chunk_min,
        chunk_avg=cfg.chunk_avg,
        chunk_max=cfg.chunk_max,
        pack_size=cfg.pack_size,
        readahead=cfg.readahead,
        prefetch_workers=cfg.prefetch_workers,
        cache_size=cfg.cache_size,
        verify_reads=cfg.verify_reads,
        writeback_cache=cfg.writeback_cache,
        durability=cfg.durability,
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def open_repo(cfg: cfgmod.Config) -> Repository:
    return Repository(Path(cfg.store), store_settings(cfg))


# -- commands -------------------------------------------------------------------------------


def cmd_mount(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from . import daemon
    from .api import MountApi
    from .gc import GarbageCollector
    from .recovery import StoreLocked, lock_store, recover

    mountpoint = Path(args.mountpoint).resolve()
    Path(cfg.store).mkdir(mode=0o700, parents=True, exist_ok=True)  # Repository tightens an old one
    try:
        lock_fd = lock_store(Path(cfg.store))  # one daemon per store, held until exit
    except StoreLocked as e:
        print(f"kv-chunk-fs: cannot mount: {e}", file=sys.stderr)
        return 1
    repo = open_repo(cfg)
    try:
        recover(repo)  # before serving: cut uncommitted pack tails, drop temp files, report damage
        collector = GarbageCollector(repo, cfg.gc_compact_threshold, cfg.gc_interval)
        try:
            # Binds STORE/api.sock (and api_address) before mounting, so the API answers once the mount is up.
            api = MountApi(cfg, repo, mountpoint, collector)
        except (OSError, RuntimeError) as e:
            print(f"kv-chunk-fs: cannot serve the API: {e}", file=sys.stderr)
            return 1
        try:
            daemon.serve(repo, mountpoint, cfg.kernel_readahead_kb, [*daemon_tasks(cfg, repo, collector), api.task])
        finally:
            api.close()
    finally:
        repo.close()
        os.close(lock_fd)
    return 0


def daemon_tasks(cfg: cfgmod.Config, repo: Repository, collector: GarbageCollector | None = None) -> list:
    """Background tasks that run beside the FUSE loop (GC timer, HTTP API)."""
    return [collector.periodic] if collector is not None else []


def cmd_gc(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from .gc import main_gc

    return main_gc(cfg, args)


def cmd_fsck(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from .fsck import main_fsck

    return main_fsck(cfg, args)


def cmd_config(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    print(cfgmod.describe(cfg))
    return 0


def cmd_export_store(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from .export import export_store

    repo = open_repo(cfg)
    try:
        n, total = export_store(repo, Path(args.dest))
    finally:
        repo.close()
    print(f"exported {n} chunks ({total} bytes) to {args.dest}")
    return 0


Command = Callable[[cfgmod.Config, argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-chunk-fs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Command, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        cfgmod.add_arguments(p)
        p.set_defaults(func=fn)
        return p

    p = add("mount", cmd_mount, "mount a store (foreground, until SIGINT/SIGTERM or fusermount3 -u)")
    p.add_argument("mountpoint")
    add("config", cmd_config, "show every effective setting and where it came from")
    p = add("export-store", cmd_export_store, "write the chunks as a loose casync/desync store")
    p.add_argument("dest")
    cliops.add_ls_arguments(add("ls", cliops.cmd_ls, "list snapshots: size, unique/shared bytes, uses, score"))
    p = add("stats", cliops.cmd_stats, "store totals: snapshots, logical/stored bytes, dedup ratio, chunks, packs")
    p.add_argument("--json", action="store_true", help="print JSON")
    cliops.add_tree_arguments(add("tree", cliops.cmd_tree, "token-prefix tree of the snapshots"))
    p = add("gc", cmd_gc, "collect garbage now (through the daemon if the store is mounted)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = add("fsck", cmd_fsck, "check a store: stubs, chunk map, packs (exit 1 if problems are found)")
    p.add_argument("--verify-data", action="store_true", help="also re-hash every chunk (reads all packs)")
    p.add_argument("--repair", action="store_true", help="remove what is unreachable, mark broken snapshots")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = cfgmod.load(args)
    except cfgmod.ConfigError as e:
        print(f"kv-chunk-fs: configuration error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    if isinstance(sys.stdout, io.TextIOWrapper):  # file names that are not UTF-8 print as their bytes
        sys.stdout.reconfigure(errors="surrogateescape")
    return args.func(cfg, args)


if __name__ == "__main__":
    sys.exit(main())
