"""rlkit's layers (docs/architecture.md, "Layers"): data flows top to bottom and nothing imports upward.
Every import in rlkit/, at module level or inside a function, is read with ast; one that reaches
a higher layer fails this test, named by file, line and both layers."""

import ast
from pathlib import Path

RLKIT = Path(__file__).resolve().parents[2] / "rlkit"

# top first; a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("rlkit.cli",),
    ("rlkit.launch",),  # config loading and validation, the one launch path
    ("rlkit.algorithms",),
    ("rlkit.cluster",),
    ("rlkit.workers", "rlkit.envs"),
    ("rlkit.refit",),  # plan, sender, receiver, transports: hosted by the workers
    ("rlkit.bridge", "rlkit.models"),
    ("rlkit.data",),
    ("rlkit.checkpoint", "rlkit.observability"),
    ("rlkit.config",),  # the schema's types and ConfigError
]


def layer_of(module: str) -> int | None:
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1] if matches else None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def upward_imports(root: Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        own = layer_of(importer)
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            target = layer_of(module)
            if own is not None and target is not None and target < own:
                problems.append(f"{path.relative_to(root.parent)}:{line} imports {module}: layer "
                                f"{LAYERS[target][0]} sits above {LAYERS[own][0]}")
    return problems


def test_every_module_has_a_layer():
    assert [m for m in (module_name(p, RLKIT) for p in RLKIT.rglob("*.py")) if layer_of(m) is None
            and m != "rlkit"] == []


def test_nothing_imports_upward():
    problems = upward_imports(RLKIT)
    assert not problems, "imports that run back up the layers:\n" + "\n".join(problems)


def test_an_upward_import_is_found_and_named(tmp_path):
    package = tmp_path / "rlkit"
    (package / "data").mkdir(parents=True)
    (package / "data" / "rows.py").write_text("import torch\n\ndef f():\n    from rlkit.cluster.groups import ModelWorkers\n")
    (package / "cluster").mkdir()
    (package / "cluster" / "groups.py").write_text("from rlkit.data.rows import f\n")
    assert upward_imports(package) == ["rlkit/data/rows.py:4 imports rlkit.cluster.groups: layer rlkit.cluster "
                                       "sits above rlkit.data"]
