"""The command line's own words: ``--version``, the top-level help, and each command's help with
its own options first (the 44 settings every command takes come after them, in a group of their
own, and stand as one ``[--SETTING VALUE ...]`` in its usage line)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
from conftest import SRC

from kvchunkfs.cli import main as cli

OWN = {  # a command -> options of its own, which its help lists before any setting
    "mount": ["--nonempty"],
    "proxy": ["--upstream", "--listen", "--mount"],
    "install-systemd": ["--unit-dir", "--mountpoint", "--exe", "--proxy"],
    "gc": ["--json", "--walk", "--remote", "--dry-run"],
    "fsck": ["--verify-data", "--repair"],
    "ui": ["--listen"],
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "kvchunkfs.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def help_of(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_version_is_the_packages() -> None:
    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"kv-chunk-fs {importlib.metadata.version('kv-chunk-fs')}"


def test_top_level_help_says_what_it_is_and_how_to_start() -> None:
    r = run("--help")
    assert r.returncode == 0
    assert "``" not in r.stdout and "Command line:" not in r.stdout, "a module docstring, not help"
    assert "FUSE filesystem for llama-server" in r.stdout
    assert "kv-chunk-fs mount /srv/kv-slots" in r.stdout and "--slot-save-path /srv/kv-slots" in r.stdout
    assert "COMMAND --help" in r.stdout
    for name in ("mount", "proxy", "gc", "install-systemd", "fsck", "ui"):
        assert f"\n    {name}" in r.stdout, name


@pytest.mark.parametrize("command", sorted(OWN))
def test_a_commands_help_lists_its_own_options_first(capsys: pytest.CaptureFixture[str], command: str) -> None:
    text = help_of(capsys, command)
    usage = text[: text.index("\n\n")]
    assert "--chunk-min" not in usage and "[--SETTING VALUE ...]" in usage, usage
    for flag in OWN[command]:
        assert flag in usage, (command, flag, usage)
    options, settings = text.index("\noptions:\n"), text.index("\nsettings:\n")
    assert options < settings
    for flag in OWN[command]:
        assert options < text.index(f"  {flag}") < settings, (command, flag)
    for flag in ("--store", "--chunk-min", "--proxy-upstream", "--log-level"):
        assert text.index(f"  {flag}") > settings, (command, flag)
