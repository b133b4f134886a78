"""Compare the installed distributions with the lock file: exit 1 listing every locked package whose
installed version differs (or that is missing). `make setup` runs it after installing from the lock.

    python tools/check_lock.py requirements.lock [--skip torch]
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path


def read_lock(path: Path) -> dict[str, str]:
    """``name==version`` lines of a lock file (comments and blank lines skipped), keyed by the
    normalised project name."""
    pins: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"{path}:{lineno}: expected 'name==version', got {raw!r}")
        pins[_normalise(name)] = version.strip()
    return pins


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lock", type=Path)
    parser.add_argument("--skip", action="append", default=[], help="a locked name not to check")
    args = parser.parse_args(argv)
    skip = {_normalise(n) for n in args.skip}
    installed = {_normalise(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = [
        f"{name}: locked {want}, installed {installed.get(name, 'nothing')}"
        for name, want in sorted(read_lock(args.lock).items())
        if name not in skip and installed.get(name) != want
    ]
    if wrong:
        print(f"{args.lock}: the environment differs from the lock:", *wrong, sep="\n  ", file=sys.stderr)
        print(
            "fix: make distclean && make setup (or make lock to refresh the lock on purpose)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
