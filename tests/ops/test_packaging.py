"""`make run` on a fresh clone installs the package quietly: setuptools warns (a long
"Package would be ignored" banner) about any folder of a package that holds files yet is not
listed in `[tool.setuptools] packages`, data-only folders included. Read from pyproject.toml
and the tree, without building."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = {"__pycache__"}


def test_every_folder_that_ships_files_is_a_listed_package() -> None:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        setuptools = tomllib.load(handle)["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    unlisted = []
    for package, folder in setuptools["package-dir"].items():
        top = ROOT / folder
        for path in [top, *top.rglob("*")]:
            parts = path.relative_to(top).parts
            if not path.is_dir() or SKIPPED & set(parts) or any(p.startswith(".") for p in parts):
                continue
            if any(child.is_file() for child in path.iterdir()):
                name = ".".join([package, *parts])
                if name not in listed:
                    unlisted.append(name)
    assert unlisted == []
    # and what is compiled at first use ships with the package that holds it
    assert any(data.endswith(".cpp") for data in setuptools["package-data"]["sluice.kernels.csrc"])
