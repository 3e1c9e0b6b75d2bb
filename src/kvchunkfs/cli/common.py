"""What every command shares: opening the store the settings name."""

from __future__ import annotations

from pathlib import Path

from kvchunkfs.config import Config
from kvchunkfs.store.repository import Repository, StoreSettings


def open_repo(cfg: Config) -> Repository:
    return Repository(Path(cfg.store), StoreSettings.from_config(cfg))
