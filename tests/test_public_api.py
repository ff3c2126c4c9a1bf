"""The public API: a curated __all__, and importing memguard has no side effects."""

from __future__ import annotations

import ast
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import memguard

# The names the design contract promises, and nothing private.
EXPECTED = {
    "ConfigError",
    "Estimate",
    "InfeasiblePlanError",
    "MemguardError",
    "MissingDependencyError",
    "OOMRecoveryError",
    "PeerFailedError",
    "Plan",
    "__version__",
    "estimate",
    "evaluate",
    "plan",
    "prepare",
    "step",
}


def test_all_is_exactly_the_contract():
    assert set(memguard.__all__) == EXPECTED
    for name in memguard.__all__:
        assert hasattr(memguard, name), name


def test_every_error_is_a_memguard_error():
    for name in ("ConfigError", "InfeasiblePlanError", "OOMRecoveryError", "PeerFailedError", "MissingDependencyError"):
        assert issubclass(getattr(memguard, name), memguard.MemguardError)


def test_import_has_no_side_effects():
    code = (
        "import json, os, sys; before = dict(os.environ); import memguard; "
        "frameworks = [m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'accelerate', 'deepspeed', 'transformers', 'matplotlib')]; "
        "print(json.dumps({'env_changed': before != dict(os.environ), 'frameworks': frameworks}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"env_changed": False, "frameworks": []}


# --- What is public is visible: a module is internal when its file name starts with "_" (as torchtune
# marks them); every other module is meant to be imported by users, declares __all__, and is listed with
# exactly those names in the README's "API reference" table.

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_files():
    """(dotted module name, path) of every module of the installed package tree, faces included."""
    for base, package in ((_ROOT / "memguard", "memguard"), (_ROOT / "integrations", "memguard.integrations")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([package, *parts]), path


def _declares_all(path: pathlib.Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
               for node in tree.body)


def _readme_reference() -> dict[str, set[str]]:
    text = (_ROOT / "README.md").read_text()
    section = text.split("\n## API reference\n", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            table[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return table


def test_internal_modules_are_marked_and_declare_no_all():
    for name, path in _module_files():
        internal = any(part.startswith("_") and part != "__main__" for part in name.split(".")[1:])
        if name.endswith("__main__"):
            continue
        assert _declares_all(path) != internal, (
            f"{name}: an internal module (a '_' name) declares no __all__, a public one declares it")


def test_readme_lists_every_public_name_by_module():
    table = _readme_reference()
    public = {name for name, path in _module_files()
              if not any(p.startswith("_") for p in name.split(".")[1:])}
    assert set(table) == public, f"README's API reference modules differ: {sorted(set(table) ^ public)}"
    for module_name, names in table.items():
        module = importlib.import_module(module_name)
        assert set(module.__all__) == names, f"{module_name}: README lists {sorted(names)}, __all__ is {sorted(module.__all__)}"
        for n in names:
            assert hasattr(module, n), f"{module_name}.{n}"
