"""The supported megatron-core releases (configs/mcore_releases.json), for the Makefile and the README.

    python3 tools/mcore_releases.py get 0.19 tests     # a field of one release (lists space-separated)
    python3 tools/mcore_releases.py readme             # the README's "Supported megatron-core releases" table

Plain Python (no megatron-ucp, no megatron-core): make reads it before any venv exists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MATRIX = Path(__file__).resolve().parent.parent / "configs" / "mcore_releases.json"


def load(path: Path = MATRIX) -> dict:
    return json.loads(path.read_text())


def release(series: str, matrix: dict | None = None) -> dict:
    """The tested release `series` ("0.19") of the matrix; KeyError naming the known ones."""
    releases = (matrix or load())["releases"]
    for r in releases:
        if r["series"] == series:
            return r
    raise KeyError(f"megatron-core {series} is not a tested release of {MATRIX.name}: "
                   f"{', '.join(r['series'] for r in releases)}")


def field(series: str, name: str) -> str:
    """One field of a release as make wants it: lists space-separated; `python_minor` is the
    major.minor of `python_tested`."""
    r = release(series)
    if name == "python_minor":
        return ".".join(r["python_tested"].split(".")[:2])
    value = r[name]
    return " ".join(value) if isinstance(value, list) else str(value)


def readme_table(matrix: dict | None = None) -> str:
    """The README table of the supported releases."""
    matrix = matrix or load()
    rows = ["| megatron-core | Python | torch | tested by `make test` |", "|---|---|---|---|"]
    for r in matrix["releases"]:
        rows.append(f"| {r['series']}.x ({r['tested']}) | {r['python']} (tested: {r['python_tested']}) "
                    f"| {r['torch']} ({r['torch_wheel']}) | {r['tests_summary']} |")
    accepted = matrix["install_requires"].removeprefix("megatron-core")
    for r in matrix["untested"]:
        rows.append(f"| {r['series']} | {r['python']} | | accepted by `setup.py` (`{accepted}`), "
                    "not tested |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["get"] and len(argv) == 3:
        print(field(argv[1], argv[2]))
    elif argv == ["readme"]:
        print(readme_table(), end="")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
