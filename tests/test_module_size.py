"""No module of the package grows past ~500 lines without saying at its top why it stays one
module (a long module is usually two concepts that want their own names)."""

import ast
import pathlib

import pytest

import samcache

ROOT = pathlib.Path(samcache.__file__).parent
LIMIT = 500
REASON = "Why this module is long:"


def long_modules():
    return sorted(p for p in ROOT.rglob("*.py") if len(p.read_text().splitlines()) > LIMIT)


def missing_reason(path: pathlib.Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return REASON not in " ".join(doc.split())


def test_every_long_module_says_why_at_its_top():
    missing = [str(p.relative_to(ROOT)) for p in long_modules() if missing_reason(p)]
    assert not missing, f"modules over {LIMIT} lines without '{REASON}' in their docstring: {missing}"


def test_the_check_finds_a_long_module_without_a_reason(tmp_path):
    long = tmp_path / "long.py"
    long.write_text('"""A module."""\n' + "x = 1\n" * (LIMIT + 1))
    assert missing_reason(long)
    long.write_text(f'"""A module.\n\n{REASON} it must be."""\n' + "x = 1\n" * (LIMIT + 1))
    assert not missing_reason(long)


@pytest.mark.parametrize("path", long_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_long_modules_are_still_few(path):
    # The reasons are read by a person; a module far past the limit wants splitting, not a reason.
    assert len(path.read_text().splitlines()) < 2 * LIMIT, f"{path.name}: split it"
