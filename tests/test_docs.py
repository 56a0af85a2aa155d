"""The docs stay true to the tree: docs/architecture.md describes every module of the package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "hora"


def described_modules() -> set[str]:
    """The paths (relative to src/hora) that the architecture's tree gives an entry."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text[text.index("src/hora/\n") :]
    tree = tree[: tree.index("```")]
    found: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, name) of the folders enclosing the line
    for line in tree.splitlines()[1:]:
        match = re.match(r"^( +)([\w.]+/?)(?:\s|$)", line)
        if not match or len(match.group(1)) % 2 or not (match.group(2).endswith((".py", "/"))):
            continue  # a continuation line of a description
        indent, name = len(match.group(1)), match.group(2)
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = "/".join([f for _, f in folders] + [name.rstrip("/")])
        if name.endswith("/"):
            folders.append((indent, name.rstrip("/")))
        found.add(path)
    return found


def test_every_module_is_in_the_architecture_tree() -> None:
    modules = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    described = described_modules()
    missing = sorted(modules - described)
    stale = sorted(p for p in described if p.endswith(".py") and p not in modules)
    assert not missing, f"docs/architecture.md's tree lacks {missing}"
    assert not stale, f"docs/architecture.md's tree names modules that do not exist: {stale}"
