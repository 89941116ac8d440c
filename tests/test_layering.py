"""flexfa's layers import only downwards, without cycles or other modules' private names.

frontend <- blockmask <- codegen <- runtime <- api (flex_attention, autograd, fp8) <- the
package's public names <- tools (bench, demo, info, the CLI, compile checks); errors, memo,
config, the kernel loader and the version sit below them all.
Every import counts, at module level or inside a function.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flexfa"

LAYERS = {
    "flexfa.errors": 0, "flexfa.memo": 0, "flexfa.config": 0, "flexfa.eager": 0,
    "flexfa.loader": 0, "flexfa.lazy": 0,
    "flexfa.frontend": 1, "flexfa.blockmask": 2, "flexfa.codegen": 3, "flexfa.runtime": 4,
    "flexfa.api": 5, "flexfa.autograd": 5, "flexfa.fp8": 5, "flexfa.mods": 5,
    "flexfa.reference": 5, "flexfa.scores": 5, "flexfa.inputs": 5, "flexfa.decode": 5,
    "flexfa.paged": 5, "flexfa.calls": 5, "flexfa.ops": 5, "flexfa.compiled": 5,
    "flexfa.made_inside": 5, "flexfa.flops": 5,
    "flexfa.features": 5, "flexfa.distributed": 5, "flexfa.prepared": 5,
    "flexfa": 6,  # the package's __init__: the public names
    "flexfa.bench": 7, "flexfa.demo": 7, "flexfa.info": 7, "flexfa.__main__": 7,
    "flexfa.compile_check": 7, "flexfa.fp8.bench": 7, "flexfa.fp8.accuracy": 7,
    "flexfa.version": 0,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def layer(module: str) -> int:
    """The layer of the longest LAYERS prefix of ``module``."""
    best = None
    for prefix, value in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, value)
    assert best is not None, f"{module} has no layer in tests/test_layering.py"
    return best[1]


def _imports(module: str, path: Path):
    """(imported module, imported names, line) for every flexfa import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flexfa":
                    yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "flexfa":
                continue
            names = tuple(alias.name for alias in node.names)
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if submodules and len(submodules) == len(names):
                for sub in submodules:
                    yield sub, (), node.lineno
            else:
                yield target, names, node.lineno


def _walk_runtime(tree):
    """ast.walk, leaving out ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _edges():
    for module, path in sorted(MODULES.items()):
        for target, names, line in _imports(module, path):
            yield module, target, names, f"{path.relative_to(PACKAGE.parent)}:{line}"


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_no_upward_imports():
    upward = [f"{where}: {module} (layer {layer(module)}) imports {target} (layer "
              f"{layer(target)})" for module, target, _, where in _edges()
              if layer(target) > layer(module)]
    assert not upward, "\n".join(upward)


def test_no_private_names_across_modules():
    private = [f"{where}: {module} imports {name} from {target}"
               for module, target, names, where in _edges() for name in names
               if name.startswith("_") and not name.startswith("__") and target != module]
    assert not private, "\n".join(private)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, target, _, _ in _edges():
        target = target if target in MODULES else target.rpartition(".")[0]
        if target in MODULES and target != module and not module.startswith(target + "."):
            # a package's __init__ importing its own submodules is not a cycle
            if not target.startswith(module + ".") or module == "flexfa":
                graph[module].add(target)
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2
    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("name", ["flexfa.runtime.forward", "flexfa.codegen.render"])
def test_the_checker_sees_imports(name):
    """A sanity check: the parser finds the imports of a module it must see."""
    assert any(True for _ in _imports(name, MODULES[name]))
