"""Every Lazy("module:attribute") in rlkit names something that exists. A Lazy is imported only when
a run reaches it, so a misspelled target would otherwise fail in a user's run, not here.

The targets' modules import torch, Ray and Megatron, so the check reads their source with ast (the
module's file exists and defines the name at its top level) instead of importing them: fast, and
the same for modules that need a GPU-only package."""

import ast
import importlib.util
from pathlib import Path

from rlkit.algorithms.registry import BUILTIN, Lazy, load_algorithm

PACKAGE = Path(__file__).resolve().parents[2] / "rlkit"


def lazy_targets_in_source() -> dict[str, str]:
    """Each Lazy(...) call in the package: {target: "file:line" of one call naming it}."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Lazy":
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                assert len(node.args) == 1 and isinstance(node.args[0], ast.Constant), \
                    f"{where}: Lazy takes one literal 'module:attribute' string, so it can be checked here"
                found.setdefault(node.args[0].value, where)
    return found


def top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def unresolved(target: str) -> str | None:
    """Why target does not resolve, or None when its module's file defines the attribute."""
    module, sep, attribute = target.partition(":")
    if not sep or not module or not attribute:
        return "not of the form 'module:attribute'"
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as e:
        return f"no module {e.name!r}"
    if spec is None:
        return f"no module {module!r}"
    if not (spec.origin or "").endswith(".py"):
        return f"no Python source for module {module!r}"
    if attribute not in top_level_names(ast.parse(Path(spec.origin).read_text())):
        return f"{spec.origin} defines no {attribute!r}"
    return None


def test_every_lazy_target_resolves():
    targets = lazy_targets_in_source()
    assert targets, "no Lazy(...) found under rlkit/: has Lazy moved or been renamed?"
    failures = {where: f"{target}: {why}" for target, where in targets.items() if (why := unresolved(target))}
    assert not failures, failures


def test_the_source_scan_sees_every_lazy_the_builtin_algorithms_hold():
    """The scan above is what checks the targets; the registered specs show it misses none."""
    held = {value.target for name in BUILTIN for value in vars(load_algorithm(name)).values()
            if isinstance(value, Lazy)}
    assert held and held <= set(lazy_targets_in_source())


def test_a_misspelled_target_is_named():
    assert "defines no 'PolicyGradientTrainr'" in unresolved("rlkit.algorithms.policy_gradient:PolicyGradientTrainr")
    assert "no module" in unresolved("rlkit.algorithms.policy_gradiant:PolicyGradientTrainer")
    assert unresolved("rlkit.algorithms.policy_gradient:PolicyGradientTrainer") is None
