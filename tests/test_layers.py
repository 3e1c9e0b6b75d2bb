"""The architecture, enforced: each package imports only the layers below it, and no module
imports another in a cycle (function-local imports included)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "src" / "kvchunkfs"

# Rank of each layer: a module may import its own layer and any of lower rank. ``fuse`` and
# ``service`` are siblings (rank 5) that must not import each other; the proxy and the dashboard are
# programs of their own on top of ``service`` (its API client), never importing ``fuse`` or each other.
LAYERS = {
    "units": 0, "formula": 0,
    "format": 1,
    "store": 2,
    "file": 3,
    "maint": 4,
    "config": 4,
    "fuse": 5, "service": 5,
    "proxy": 6, "dashboard": 6,
    "cli": 7,
}  # fmt: skip
SIBLINGS_APART = {
    ("fuse", "service"), ("service", "fuse"),
    ("proxy", "fuse"), ("dashboard", "fuse"), ("proxy", "dashboard"), ("dashboard", "proxy"),
}  # fmt: skip
ROOT_ONLY = {"__init__"}  # kvchunkfs/__init__.py: the version, importable by anyone


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kvchunkfs" or len(parts) == 1:
        return None
    return parts[1]


def imports_of(path: Path) -> set[str]:
    """Every kvchunkfs module ``path`` imports, at any depth (top-level or inside functions)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvchunkfs")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("kvchunkfs"):
                continue
            for alias in node.names:  # "from kvchunkfs.store import stubs" imports a module
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return found


def _is_module(name: str) -> bool:
    path = PKG.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def test_every_module_belongs_to_a_layer():
    for name in all_modules():
        layer = layer_of(name)
        assert layer is None or layer in LAYERS or layer in ROOT_ONLY, f"{name}: add its package to LAYERS"


@pytest.mark.parametrize("name", sorted(all_modules()))
def test_imports_follow_the_layers(name: str):
    mine = layer_of(name)
    if mine is None or mine in ROOT_ONLY:
        return
    for target in imports_of(all_modules()[name]):
        theirs = layer_of(target)
        if theirs is None or theirs in ROOT_ONLY:
            continue
        assert LAYERS[theirs] <= LAYERS[mine], f"{name} ({mine}) imports {target} ({theirs}), a higher layer"
        assert (mine, theirs) not in SIBLINGS_APART, f"{name} imports {target}: {mine} and {theirs} stay apart"


# What the FUSE layer may not reach past: stubs and store paths go through ``Repository`` (which
# tells the catalog of each change), a file's write modes and thread hops through ``FileHandle``.
FUSE_NEVER = {
    "kvchunkfs.store.stubs": None,  # the whole module
    "kvchunkfs.file.content": {"Mode"},
    "kvchunkfs.file.reader": None,
}


@pytest.mark.parametrize("name", sorted(n for n in all_modules() if layer_of(n) == "fuse"))
def test_the_fuse_layer_stays_thin(name: str):
    tree = ast.parse(all_modules()[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                assert FUSE_NEVER.get(a.name, ()) is not None, f"{name} imports {a.name}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                assert FUSE_NEVER.get(full, ()) is not None, f"{name} imports {full}"
                banned = FUSE_NEVER.get(node.module, ())
                assert banned is not None and a.name not in banned, f"{name} imports {a.name} from {node.module}"


# The kernel protocol, spoken by the session: these modules know nothing but ``fuse/`` (no store,
# no file, no repository), as go-fuse's raw server knows nothing of its node API.
PROTOCOL_ONLY = ("session", "protocol", "kernel", "splicing", "api", "backing", "rawbridge", "setid")


@pytest.mark.parametrize("short", PROTOCOL_ONLY)
def test_the_session_speaks_the_protocol_only(short: str):
    name = f"kvchunkfs.fuse.{short}"
    for target in imports_of(all_modules()[name]):
        assert target.startswith("kvchunkfs.fuse."), f"{name} imports {target}: the protocol side imports only fuse/"


def test_the_session_leaves_the_opens_rules_to_the_bridge():
    """Which backing file an open passes through to and when (fuse/backing.py), and the set-id rule
    (fuse/setid.py), are the bridge's (fuse/rawbridge.py), as in go-fuse: the session reads,
    dispatches and answers requests, and reaches those rules only through the bridge."""
    imported = imports_of(all_modules()["kvchunkfs.fuse.session"])
    assert "kvchunkfs.fuse.rawbridge" in imported, "the session answers opens through fuse/rawbridge.py"
    for rule in ("kvchunkfs.fuse.backing", "kvchunkfs.fuse.setid"):
        assert rule not in imported, f"the session imports {rule}: that rule is the bridge's"
    source = (PKG / "fuse" / "session.py").read_text()
    for word in ("Backings", "S_ISUID", "S_ISGID", "OPEN_KILL_SUIDGID and", "turn_over"):
        assert word not in source, f"the session holds {word!r}: that rule is the bridge's"


def test_the_save_service_knows_nothing_of_fuse():
    """A save's life (file/saves.py) is the save service's, out of the FUSE layer: the file system
    calls it, never the other way round."""
    modules = all_modules()
    assert "kvchunkfs.file.saves" in modules, "the save service is file/saves.py"
    for target in imports_of(modules["kvchunkfs.file.saves"]):
        assert layer_of(target) != "fuse", f"the save service imports {target}"
    text = modules["kvchunkfs.file.saves"].read_text()
    assert "inode" not in text and "ino" not in text.split(), "the save service knows no inode numbers"


# One concept per module: no module of these packages grows past this many lines.
SIZE_RULED = ("file", "fuse", "maint", "service")
MAX_LINES = 800
# Known to be over the limit while they are being split; to be removed from this list (and the
# list emptied) as each one shrinks. Nothing is ever added to it.
TOO_BIG_UNTIL_SPLIT: set[str] = set()


def test_no_module_is_too_long():
    lines = {name: len(path.read_text().splitlines()) for name, path in all_modules().items()
             if layer_of(name) in SIZE_RULED}  # fmt: skip
    too_long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not too_long.keys() - TOO_BIG_UNTIL_SPLIT, f"over {MAX_LINES} lines: {too_long}"
    shrunk = {name for name in TOO_BIG_UNTIL_SPLIT if lines.get(name, 0) <= MAX_LINES}
    assert not shrunk, f"{shrunk}: within {MAX_LINES} lines now, remove from TOO_BIG_UNTIL_SPLIT"


def test_no_import_cycles():
    modules = all_modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target in imports_of(path):
            if target in modules and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    cycles = _cycles(graph)
    assert not cycles, f"import cycles: {cycles}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cli_tree_command_does_not_load_the_http_stack():
    """``kv-chunk-fs tree`` and ``ls`` talk to a daemon with http.client; Starlette/uvicorn are the
    daemon's, not the CLI's (the import used to come in through ``cliops -> api``)."""
    import subprocess
    import sys

    code = (
        "import sys, kvchunkfs.cli.ops, kvchunkfs.cli.main;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'trio')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": str(PKG.parent)}
    ).stdout.strip()
    assert out == "[]", out
