"""Command line: ``kv-chunk-fs mount|config|export-store|...``."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchunkfs import config as cfgmod
from kvchunkfs.cli import ops as cliops
from kvchunkfs.cli.common import open_repo, operator_error, writable_problem
from kvchunkfs.file.files import Files
from kvchunkfs.store.layout import Layout, StoreLocked, lock_store, try_lock_store
from kvchunkfs.store.remote import RemoteTier
from kvchunkfs.store.repository import Repository
from kvchunkfs.store.wholefiles import WholeFilesError

if TYPE_CHECKING:
    from kvchunkfs.maint.gc import GarbageCollector

log = logging.getLogger("kvchunkfs")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# -- commands -------------------------------------------------------------------------------


def cmd_mount(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from kvchunkfs.fuse import daemon
    from kvchunkfs.maint.gc import GarbageCollector
    from kvchunkfs.maint.recovery import prepare_map_file, recover
    from kvchunkfs.service import logbuffer
    from kvchunkfs.service.api import MountApi
    from kvchunkfs.store import wholefiles

    mountpoint = Path(args.mountpoint).resolve()
    problem = daemon.check_mountpoint(mountpoint, args.nonempty)
    if problem is not None:
        print(f"kv-chunk-fs: cannot mount: {problem}", file=sys.stderr)
        return 2
    wholefiles.check_dir(Path(cfg.store), cfg.whole_files_dir)  # before recovery logs a line
    try:
        Path(cfg.store).mkdir(mode=0o700, parents=True, exist_ok=True)  # Repository tightens an old one
    except OSError as e:
        print(f"kv-chunk-fs: cannot mount: cannot create the store {cfg.store}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        lock_fd = lock_store(Path(cfg.store))  # one daemon per store, held until exit
    except StoreLocked as e:
        print(f"kv-chunk-fs: cannot mount: {e}", file=sys.stderr)
        return 2
    moved_aside = prepare_map_file(Path(cfg.store))  # an unreadable chunks.db is rebuilt from the packs
    logs = logbuffer.install()  # before recovery: its summary shows in GET /logs (the dashboard's Logs tab)
    repo = open_repo(cfg)
    files = Files(repo)
    files.reserve_buffers()
    clean = False
    try:
        recover(repo, moved_aside)  # before serving: catch the map up with the packs, drop temp files, report damage
        daemon.trim_memory()  # a full check read every map row: its pages go back before serving
        if cfg.remote:
            try:
                repo.remote = _remote_tier(cfg, repo)
            except OSError as e:  # e.g. boto3 not installed
                print(f"kv-chunk-fs: cannot use remote {cfg.remote}: {e}", file=sys.stderr)
                return 2
            if not _remote_format_ok(repo.remote):
                return 2
            repo.remote.start()  # resumes what a previous run left unuploaded
        collector = GarbageCollector(repo, cfg.gc_compact_threshold, cfg.gc_interval, cfg.gc_walk_interval)
        if repo.remote is not None and cfg.local_cache_size:
            _cache_locally(repo, repo.remote, collector, cfg.local_cache_size)
        try:
            # Binds STORE/api.sock (and api_address) before mounting, so the API answers once the mount is up.
            api = MountApi(cfg, files, mountpoint, collector, logs)
        except (OSError, RuntimeError) as e:
            print(f"kv-chunk-fs: cannot serve the API: {e} (set api_address to a free address, or empty for none)",
                  file=sys.stderr)  # fmt: skip
            return 2
        collector.names = api.service.live  # its reference counts: GC runs without reading every stub
        collector.trim = daemon.trim_memory
        try:
            daemon.serve(
                files,
                mountpoint,
                cfg.kernel_readahead_kb,
                [lambda _ops: collector.periodic(), api.task],
                cfg.memory_trim_above,
                cfg.stop_timeout,
            )
        except WholeFilesError as e:  # e.g. a memory-tier directory another user could swap
            print(f"kv-chunk-fs: cannot mount: {e}", file=sys.stderr)
            return 2
        finally:
            api.close()
            collector.close()
        clean = True  # serve returned: unmounted, every save finished
    finally:
        if repo.remote is not None:
            repo.remote.close()
        files.remember_buffers()
        files.close()
        if clean:
            _mark_clean(repo)
        repo.close()
        os.close(lock_fd)
        logging.getLogger().removeHandler(logs)
    return 0


def cmd_free_memory_tiers(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from kvchunkfs.store import tierdir

    freed = tierdir.sweep(kept_too=args.all)
    for root, why, n in freed:
        print(f"freed {root} ({n >> 20} MiB): {why}")
    print(f"{len(freed)} memory tiers freed, {sum(n for _, _, n in freed) >> 20} MiB")
    return 0


def _cache_locally(repo: Repository, tier: RemoteTier, collector: GarbageCollector, limit: int) -> None:
    """``local_cache_size``: evict after every GC run and whenever uploads drain or a fetch added
    chunks while the packs are over the limit (in the collector's thread, never the FUSE thread)."""
    from kvchunkfs.maint.evict import Evictor

    evictor = Evictor(repo, tier, limit)
    collector.evictor = evictor

    def check() -> None:
        if evictor.wanted():
            collector.evict_soon()

    tier.on_idle = check


def _remote_format_ok(tier: RemoteTier) -> bool:
    """The bucket's recorded format against this store's: a mismatch fails the mount (the operator
    asked for a shared tier this host cannot use; a mount without it would quietly stop sharing).
    An unreachable bucket does not: the tier checks again before its first use."""
    from kvchunkfs.store.bucketformat import FormatMismatch

    try:
        tier.check_format()
    except FormatMismatch as e:
        print(f"kv-chunk-fs: cannot mount: {e.strerror}", file=sys.stderr)
        return False  # the caller's cleanup closes the tier
    except OSError as e:
        logging.getLogger(__name__).warning("remote %s unreachable, its format is checked before first use: %s",
                                            tier.bucket.url, e)  # fmt: skip
    return True


def _remote_tier(cfg: cfgmod.Config, repo: Repository) -> RemoteTier:
    from kvchunkfs.store.bucketformat import LOOSE, PACKED, BucketFormat
    from kvchunkfs.store.remote import RemoteTier
    from kvchunkfs.store.s3 import Bucket

    c = repo.chunker
    # A new bucket gets the layout of the host that creates it; later hosts write the bucket's.
    fmt = BucketFormat(PACKED if cfg.remote_pack_size else LOOSE, c.kind, c.min, c.avg, c.max, c.group_w)
    return RemoteTier(
        repo,
        Bucket(cfg.remote, cfg.remote_endpoint),
        upload_workers=cfg.remote_upload_workers,
        fetch_workers=cfg.remote_fetch_workers,
        grace=cfg.remote_grace,
        list_ttl=cfg.remote_list_ttl,
        fmt=fmt,
        max_file_size=cfg.max_file_size,
        pack_size=cfg.remote_pack_size,
    )


def cmd_gc_remote(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from kvchunkfs.maint.remotegc import run_remote_gc
    from kvchunkfs.store.remotecore import max_index_bytes
    from kvchunkfs.store.s3 import Bucket

    if not cfg.remote:
        print("kv-chunk-fs: gc --remote needs the remote setting (s3://bucket/prefix)", file=sys.stderr)
        return 2
    try:
        bucket = Bucket(cfg.remote, cfg.remote_endpoint)
        limit = max_index_bytes(cfg.max_file_size, cfg.chunk_min)
        report = run_remote_gc(bucket, cfg.remote_grace, args.dry_run, limit, cfg.max_file_size,
                               cfg.remote_pack_size or 16 << 20, args.convert)  # fmt: skip
    except OSError as e:
        print(f"kv-chunk-fs: gc --remote failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 1 if report.errors else 0


def _mark_clean(repo: Repository) -> None:
    try:
        repo.sync()
        repo.store.set_clean_mark()
    except OSError as e:  # the next mount checks every snapshot: slower, not wrong
        log.warning("could not mark the store cleanly unmounted: %s", e)


def cmd_gc(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    """Through the daemon's API if it holds the store, else right here. ``--dry-run``: what a run
    would free, deleting nothing (offline without recovery's repairs either: they change the store)."""
    from kvchunkfs.maint.gc import plan_gc, run_gc
    from kvchunkfs.maint.gcreport import format_summary
    from kvchunkfs.maint.recovery import prepare_map_file, recover

    if args.collect_remote:
        return cmd_gc_remote(cfg, args)
    root = Path(cfg.store)
    if not Layout(root).is_store():
        print(f"kv-chunk-fs: no store at {root}", file=sys.stderr)
        return 2
    lock_fd = try_lock_store(root)
    try:
        if lock_fd is None:
            params = {"walk": "true"} if args.walk else {}
            if args.dry_run:
                params["dry_run"] = "true"
            result = _through_daemon(root, "POST", "/gc", params or None)
        elif args.dry_run:
            repo = open_repo(cfg)
            try:
                result = plan_gc(repo, cfg.gc_compact_threshold).to_dict()
            finally:
                repo.close()
        else:
            moved_aside = prepare_map_file(root)  # an unreadable chunks.db is rebuilt from the packs
            repo = open_repo(cfg)
            try:
                recover(repo, moved_aside)  # a crashed daemon's leftovers first: the map caught up with the packs
                result = run_gc(repo, cfg.gc_compact_threshold).to_dict()
            finally:
                repo.close()
    except (OSError, RuntimeError) as e:
        print(f"kv-chunk-fs: gc failed: {e}", file=sys.stderr)
        return 1
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    print(json.dumps(result, indent=2) if args.json else format_summary(result))
    return 1 if result.get("errors") else 0


def _through_daemon(root: Path, method: str, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
    from kvchunkfs.service.apiclient import DaemonClient

    try:
        return DaemonClient(root).json(method, path, params)
    except OSError as e:
        sock = Layout(root).socket
        raise OSError(e.errno, f"the store is mounted but its daemon does not answer on {sock}: {e}") from e


def cmd_fsck(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    """Exit 0 if the store is clean, 1 if problems were found, 2 if it could not run."""
    from kvchunkfs.maint.fsck import Subset, run_fsck
    from kvchunkfs.maint.fsckadvice import advice

    try:
        subset = None if args.verify_data in (None, "all") else Subset.parse(args.verify_data)
    except ValueError as e:
        print(f"kv-chunk-fs: fsck: {e}", file=sys.stderr)
        return 2
    bar = ProgressBar()
    try:
        report = run_fsck(Path(cfg.store), args.verify_data is not None, args.repair, bar.show,
                          lambda: open_repo(cfg), subset)  # fmt: skip
    except OSError as e:
        print(f"kv-chunk-fs: fsck: {operator_error(e)}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"kv-chunk-fs: fsck: {e}", file=sys.stderr)
        return 2
    finally:
        bar.done()
    if report.live:  # a daemon serves the store: its reference counts against the stubs
        from kvchunkfs.service.catalog import compare_with_daemon

        report.counts_compared, differ, report.counts_skipped = compare_with_daemon(Path(cfg.store))
        report.problems += differ
    for line in report.problems:
        print(f"problem: {line}")
    for line in report.repaired:
        print(f"repaired: {line}")
    for line in report.skipped:
        print(f"skipped: {line}")
    for line in advice(report):
        print(f"what to do: {line}")
    print(report.summary())
    return 1 if report.problems else 0


class ProgressBar:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()
        self._last = 0.0

    def show(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if not label:  # a phase ended
            self.done()
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{label:<8} [{bar:<30}] {100 * frac:5.1f}%")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 50 + "\r")
            sys.stderr.flush()


def cmd_config(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    print(cfgmod.describe(cfg))
    return 0


def cmd_export_store(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from kvchunkfs.maint.export import export_store

    repo = open_repo(cfg)
    try:
        n, total = export_store(repo, Path(args.dest))
    finally:
        repo.close()
    print(f"exported {n} chunks ({total} bytes) to {args.dest}")
    return 0


def cmd_file_order(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    """What ``casync extract`` gives for a snapshot of a ``relayout`` store is the stored stream:
    K/V blocks token-major. This puts them back (a file with no stored group is copied as it is).
    With ``--stub``, the groups are the ones its file record lists and the result is checked
    against its file checksum: nothing is written if it does not match."""
    from kvchunkfs.format import filerecord, relayout
    from kvchunkfs.format.cutter import GROUP_WIDTH
    from kvchunkfs.store import stubs

    data = memoryview(Path(args.input).read_bytes())
    record = None
    if args.stub:
        raw = stubs.read_record(args.stub)
        if raw is None:
            print(f"kv-chunk-fs: {args.stub} has no file record (saved before records): not checked", file=sys.stderr)
        else:
            try:
                record = filerecord.decode(raw, len(data))
            except filerecord.RecordError as e:
                print(f"kv-chunk-fs: {args.stub}: {e}", file=sys.stderr)
                return 1

    def read(off: int, n: int) -> bytes:
        return bytes(data[off : off + n])

    if record is not None and record.form.groups_given:
        found = record.segments
    else:
        found = relayout.groups(read, len(data), GROUP_WIDTH)
    pieces = list(relayout.file_pieces(read, len(data), found))
    if record is not None:
        why = filerecord.mismatch(pieces, record)
        if why is not None:
            print(f"kv-chunk-fs: {args.input} is not the file {args.stub} records: {why}", file=sys.stderr)
            return 1
    Path(args.output).write_bytes(b"".join(bytes(piece) for _, piece in pieces))
    return 0


def cmd_ui(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    """The dashboard, in this process: a separate server, so the daemon never serves a browser."""
    from kvchunkfs.dashboard import server as dashboard
    from kvchunkfs.service.api import split_address

    try:
        host, port = split_address(args.listen if ":" in args.listen else f"127.0.0.1:{args.listen}")
        token = cfgmod.api_token(cfg)
    except (ValueError, cfgmod.ConfigError) as e:
        print(f"kv-chunk-fs: ui: {e}", file=sys.stderr)
        return 2
    if not dashboard.loopback(host) and not token and not cfg.api_insecure_no_token:
        print(f"kv-chunk-fs: ui: refusing to listen on {host} without a token: set api_token_file (or use an SSH "
              "tunnel to the default 127.0.0.1)", file=sys.stderr)  # fmt: skip
        return 2
    url = dashboard.base_url(host, port)
    if token:
        print(f"kv-chunk-fs: dashboard on {url} (token: the configured api_token)", file=sys.stderr)
    else:  # every local user can reach the port: a token for this run, handed over in the URL (as Jupyter does)
        token = dashboard.new_token()
        print(f"kv-chunk-fs: dashboard on {url}?token={token}", file=sys.stderr)
    sys.stderr.flush()
    dashboard.serve(Path(cfg.store), host, port, token)
    return 0


def cmd_install_systemd(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    from kvchunkfs.cli import systemd

    exe = args.exe or systemd.default_exe()
    try:
        mount_lines, proxy_lines = systemd.assignments(cfg, args.proxy)
    except systemd.Refused as e:
        print(f"kv-chunk-fs: install-systemd: cannot write {e}", file=sys.stderr)
        return 2
    if args.mountpoint is not None:  # also in the drop-in: an older drop-in's would win over the unit's
        mount_lines.insert(0, ("Environment", f"KVCFS_MOUNTPOINT={Path(args.mountpoint).absolute()}"))
        proxy_lines.insert(0, mount_lines[0])
    mountpoint = str(Path(args.mountpoint or systemd.DEFAULT_MOUNTPOINT).absolute())
    try:
        written = systemd.install(Path(args.unit_dir), exe, mountpoint, cfg.stop_timeout, mount_lines)
        if args.proxy:
            written += systemd.install_proxy(Path(args.unit_dir), exe, mountpoint, proxy_lines)
    except OSError as e:
        print(f"kv-chunk-fs: install-systemd: {e.filename or args.unit_dir}: {e.strerror or e} (as root, or "
              "--unit-dir DIR)", file=sys.stderr)  # fmt: skip
        return 2
    for path in written:
        print(f"wrote {path}")
    print(
        "now: systemctl daemon-reload && systemctl enable --now kv-chunk-fs"
        + (" kv-chunk-fs-proxy" if args.proxy else "")
    )
    return 0


def cmd_proxy(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    import asyncio

    from kvchunkfs.proxy.cache import WrongMount
    from kvchunkfs.proxy.mountcheck import check_mount
    from kvchunkfs.proxy.server import Proxy, serve
    from kvchunkfs.proxy.startup import probe_upstream, resolve_mount

    if cfg.proxy_mount is None:
        print("kv-chunk-fs: proxy needs --mount (proxy_mount): the mounted --slot-save-path of llama-server",
              file=sys.stderr)  # fmt: skip
        return 2
    found = resolve_mount(Path(cfg.proxy_mount), Path(cfg.store), cfg.sources.get("store", "default") != "default")
    if isinstance(found, str):
        print(f"kv-chunk-fs: proxy: {found}", file=sys.stderr)
        return 2
    mount, store = found
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    layout = asyncio.run(probe_upstream(cfg.proxy_upstream, mount))  # is llama-server saving into the mount?
    if isinstance(layout, WrongMount):
        print(f"kv-chunk-fs: proxy: {layout}", file=sys.stderr)
        return 2
    proxy = Proxy(cfg.proxy_upstream, mount, store, min_restore=cfg.proxy_min_restore,
                  cache_max_bytes=cfg.cache_max_bytes, max_body=cfg.proxy_max_body,
                  max_prompt_tokens=cfg.proxy_max_prompt_tokens, tenant=cfg.proxy_tenant)  # fmt: skip
    if layout is not None:
        proxy.learn_layout(layout)  # what the probe save at start told
    log.info("proxy on %s for %s, saving into %s (store %s)", cfg.proxy_listen, cfg.proxy_upstream, mount, store)
    if layout is None:
        log.info("llama-server's KV layout and --slot-save-path are checked with the first request")
    checked = check_mount(mount, store)
    log.log(checked.level, "%s", checked.line)
    proxy.mount_ok = checked.mounted  # the first skipped save warns only if this changed
    serve(proxy, cfg.proxy_listen)
    return 0


Command = Callable[[cfgmod.Config, argparse.Namespace], int]
_CONFIGURED = "\0configured"  # ``gc --remote`` without a value


DESCRIPTION = """\
A deduplicating FUSE filesystem for llama-server's slot snapshots: mount it as llama-server's
--slot-save-path, and put `kv-chunk-fs proxy` in front of llama-server for a disk prompt cache."""
EPILOG = """\
start:  kv-chunk-fs mount /srv/kv-slots
        llama-server --slot-save-path /srv/kv-slots --port 8080 ...
        kv-chunk-fs proxy --upstream http://127.0.0.1:8080 --mount /srv/kv-slots

`kv-chunk-fs COMMAND --help` lists the command's options, then the settings every command takes
(each also a key of the TOML config file and a KV_CHUNK_FS_<NAME> variable; `kv-chunk-fs config`
shows them with where each came from)."""


def build_parser() -> argparse.ArgumentParser:
    from kvchunkfs import __version__

    parser = argparse.ArgumentParser(prog="kv-chunk-fs", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    commands: list[argparse.ArgumentParser] = []

    def add(name: str, fn: Command, help_text: str, **kwargs: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text[:1].upper() + help_text[1:] + ".", **kwargs)
        p.set_defaults(func=fn)
        commands.append(p)
        return p

    p = add("mount", cmd_mount, "mount a store (foreground, until SIGINT/SIGTERM or fusermount3 -u)")
    p.add_argument("mountpoint")
    p.add_argument(
        "--nonempty",
        action="store_true",
        help="mount over a directory that holds files (they stay hidden until the unmount)",
    )
    add("config", cmd_config, "show every effective setting and where it came from")
    p = add("export-store", cmd_export_store, "write the chunks as a loose casync/desync store")
    p.add_argument("dest")
    p = add("file-order", cmd_file_order, "turn what casync extracts from a relayout store's snapshot back "
            "into the llama.cpp state file")  # fmt: skip
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument(
        "--stub",
        default=None,
        help="the snapshot's stub (STORE/snapshots/...): put its groups back as its file record says and "
        "check the file's checksum",
    )
    cliops.add_ls_arguments(add("ls", cliops.cmd_ls, "list snapshots: size, unique/shared bytes, uses, score"))
    p = add("stats", cliops.cmd_stats, "store totals: snapshots, logical/stored bytes, dedup ratio, chunks, packs")
    p.add_argument("--json", action="store_true", help="print JSON")
    cliops.add_tree_arguments(add("tree", cliops.cmd_tree, "token-prefix tree of the snapshots"))
    p = add("proxy", cmd_proxy, "serve llama-server's API with a disk prompt cache on the mount (see README)")
    p.add_argument(
        "--upstream",
        dest="proxy_upstream",
        default=None,
        metavar="URL",
        help="llama-server to forward to (the proxy_upstream setting, default http://127.0.0.1:8080)",
    )
    p.add_argument(
        "--listen",
        dest="proxy_listen",
        default=None,
        metavar="HOST:PORT",
        help="address to serve on (the proxy_listen setting, default 127.0.0.1:8081)",
    )
    p.add_argument("--mount", dest="proxy_mount", default=None, metavar="DIR",
                   help="llama-server's --slot-save-path, where `kv-chunk-fs mount` serves (the proxy_mount "
                   "setting); the mount names its store")  # fmt: skip
    # gc's own --remote stands for the setting's flag; it also works without a value (the setting's)
    p = add("gc", cmd_gc, "collect garbage now (through the daemon if the store is mounted)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--walk",
        action="store_true",
        help="read every stub (a mounted daemon otherwise looks only at what changed since its last run)",
    )
    p.add_argument(
        "--remote",
        nargs="?",
        const=_CONFIGURED,
        default=None,
        metavar="s3://BUCKET/PREFIX",
        help="collect the bucket's chunks instead (unnamed by any index and older than remote_grace)",
    )
    p.add_argument("--dry-run", action="store_true", help="report what would be freed, delete nothing (locally, "
                   "or in the bucket with --remote)")  # fmt: skip
    p.add_argument("--convert", action="store_true",
                   help="with --remote: put loose chunks into packs, then collect the loose copies (once every "
                   "host runs a version that reads packs)")  # fmt: skip
    p = add("ui", cmd_ui, "web dashboard of the running daemon (through its unix socket)")
    p.add_argument("--listen", default="127.0.0.1:8765", metavar="HOST:PORT",
                   help="address to serve on (default 127.0.0.1:8765; other than loopback needs a token)")  # fmt: skip
    from kvchunkfs.cli import systemd

    systemd.add_arguments(add("install-systemd", cmd_install_systemd, "install the systemd unit (Type=notify) and a "
                              "settings drop-in; --proxy: the proxy's too"))  # fmt: skip
    p = add("free-memory-tiers", cmd_free_memory_tiers, "free the memory tiers of this user's whose store is "
            "gone or that no daemon serves (never a staged save of a store that exists)")  # fmt: skip
    p.add_argument("--all", action="store_true", help="also those a stopped daemon kept for its next start")
    p = add("fsck", cmd_fsck, "check a store: stubs, chunk map, packs (exit 1 if problems are found); without "
            "--verify-data it reads no chunk bytes, so a byte changed inside a pack goes unnoticed")  # fmt: skip
    p.add_argument("--verify-data", nargs="?", const="all", default=None, metavar="SUBSET",
                   help="also re-hash the chunks: every one (reads all packs), or a SUBSET for routine runs: a "
                   "share (10%%) or a byte budget (2GiB), packs in order from a random one")  # fmt: skip
    p.add_argument("--repair", action="store_true", help="remove what is unreachable, mark broken snapshots")
    for p in commands:
        _add_settings(p)
    return parser


STORELESS = {"config", "install-systemd", "file-order", "free-memory-tiers"}  # commands that never open the store
WRITERS = {"mount", "fsck", "gc", "stats", "tree", "export-store"}  # need to write the store (its lock, the map's)


def store_problem(store: Path) -> str | None:
    """Why ``store`` cannot be the store directory (a file, or a path through one), or None; a
    missing one is for each command to create or report."""
    try:
        mode = os.stat(store).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot use the store: {operator_error(e)}"
    return None if stat.S_ISDIR(mode) else f"the store {store} is not a directory (set --store or KV_CHUNK_FS_STORE)"


def _store_of_mountpoint(cfg: cfgmod.Config) -> cfgmod.Config:
    """``--store MOUNTPOINT`` means the store that kv-chunk-fs mount serves (the mount table names it)."""
    import dataclasses

    from kvchunkfs.fuse.mounts import FSTYPE, fuse_mount_of

    try:
        entry = fuse_mount_of(Path(cfg.store))
    except OSError:
        return cfg
    if entry is None or entry.fstype != FSTYPE or entry.mountpoint != os.path.realpath(cfg.store):
        return cfg
    store = entry.source.partition(":")[2].replace("\\,", ",").replace("\\\\", "\\")
    return dataclasses.replace(cfg, store=Path(store)) if store else cfg


def _add_settings(p: argparse.ArgumentParser) -> None:
    """Every setting as a flag of command ``p``, listed after the command's own options (added
    before), and in its usage line as one ``[SETTING ...]`` (not 44 flags before its own)."""
    own = p.format_usage().removeprefix("usage: ").rstrip()
    p.usage = own.replace("%", "%%") + " [--config PATH] [--SETTING VALUE ...]"
    about = "of the store and the daemon; each also a key of the TOML config file and a KV_CHUNK_FS_<NAME> variable"
    group = p.add_argument_group("settings", about + " (see `kv-chunk-fs config`)")
    cfgmod.add_arguments(group, skip={flag for action in p._actions for flag in action.option_strings})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.collect_remote = args.command == "gc" and args.remote is not None
    if args.remote == _CONFIGURED:
        args.remote = None
    try:
        cfg = cfgmod.load(args)
    except cfgmod.ConfigError as e:
        print(f"kv-chunk-fs: configuration error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    if args.command not in STORELESS and args.command != "mount":
        cfg = _store_of_mountpoint(cfg)
    problem = None if args.command in STORELESS else store_problem(Path(cfg.store))
    if problem is None and args.command in WRITERS and not args.collect_remote:
        problem = writable_problem(Path(cfg.store))
    if problem is not None:
        print(f"kv-chunk-fs: {problem}", file=sys.stderr)
        return 2
    if isinstance(sys.stdout, io.TextIOWrapper):  # file names that are not UTF-8 print as their bytes
        sys.stdout.reconfigure(errors="surrogateescape")
    try:
        return int(args.func(cfg, args))
    except OSError as e:  # what the operator can fix (a full disk, a directory's owner or mode): one line
        log.debug("%s failed", args.command, exc_info=True)
        print(f"kv-chunk-fs: {args.command}: {operator_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
