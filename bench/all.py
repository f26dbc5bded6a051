"""Run every bench and rewrite `bench/RESULTS.md` (what `make bench` does).

python bench/all.py            # every bench
python bench/all.py forward    # some of them
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(names: list[str]) -> int:
    found = sorted(
        p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_") and p.stem != "all"
    )
    failed = []
    for name in names or found:
        if name not in found:
            print(f"no bench named {name!r}; the benches are {found}", file=sys.stderr)
            return 2
        print(f"# bench/{name}.py", flush=True)
        if subprocess.call([sys.executable, str(HERE / f"{name}.py"), "--results"]) != 0:
            failed.append(name)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
