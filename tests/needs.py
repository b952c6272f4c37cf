"""Skip a test module when an optional component (a peer's client library, a server binary) is
missing, except under ``make test`` (``SAMCACHE_REQUIRE_PEERS=1``), which installs every one of
them: there a missing component fails the run, so CI cannot stay green by skipping its tests."""

from __future__ import annotations

import importlib
import os
import shutil

import pytest


def required() -> bool:
    return os.environ.get("SAMCACHE_REQUIRE_PEERS") == "1"


def _missing(message: str) -> None:
    if required():
        pytest.fail(f"{message} (SAMCACHE_REQUIRE_PEERS=1: make test installs it)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def need_module(name: str, install_hint: str):
    """The imported module ``name``; skip (or fail, see above) if it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        _missing(f"cannot import {name} ({e}); {install_hint}")


def need_program(name: str, install_hint: str) -> str:
    """The path of the program ``name`` on PATH; skip (or fail) without it."""
    path = shutil.which(name)
    if path is None:
        _missing(f"{name} is not on PATH; {install_hint}")
    return path


def need_file(path: str, install_hint: str) -> str:
    """``path`` if it is a file (e.g. another environment's Python); skip (or fail) without it."""
    if not os.path.isfile(path):
        _missing(f"{path} does not exist; {install_hint}")
    return path
