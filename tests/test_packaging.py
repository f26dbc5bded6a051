"""What a user installs: the wheel built from this tree holds every file the package reads
besides its code (the widgets' JavaScript and CSS, which nothing fetches from the network) and
`py.typed`, so that a type checker reads the annotations of an installed somatize."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_file_the_package_ships(tmp_path):
    tracked = subprocess.run(
        ["git", "ls-files", "somatize"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assets = {f for f in tracked if not f.endswith(".py")}
    assert "somatize/py.typed" in assets and any(f.endswith(".js") for f in assets)
    source = tmp_path / "src"  # the tracked files alone: no build/ left by an earlier build
    for name in [*tracked, "pyproject.toml", "README.md"]:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("somatize-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    assert assets <= held, sorted(assets - held)
    code = {f for f in tracked if f.endswith(".py")}
    assert code <= held, sorted(code - held)
