"""Where things are, for tests at any depth of tests/: the repository root and tests/ itself
(where the shared helpers, handler modules and tests/js live)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
