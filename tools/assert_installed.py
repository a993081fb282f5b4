"""Fail unless a module imports from an installed copy (site-packages), not the source tree.

python tools/assert_installed.py kvarn_formats packages/kvarn-formats
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    module_name, source_dir = argv
    module = importlib.import_module(module_name)
    if module.__file__ is None:
        print(f"{module_name} is a namespace package, not an installed copy", file=sys.stderr)
        return 1
    where = Path(module.__file__).resolve()
    source = Path(source_dir).resolve()
    if source in where.parents or "site-packages" not in where.parts:
        print(f"{module_name} imports from {where}, not from an installed copy", file=sys.stderr)
        return 1
    print(f"{module_name} imported from {where.parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
