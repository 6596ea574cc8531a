"""The shape of the package, read from its source: no import cycles, and the layering
docs/architecture.md describes (kernels import nothing of ours, the scheduler core no trio,
sockets or model and of ours only the vocabulary it shares with the wire, `ipc/` no actor,
daemon or console, the console only `ipc/`, no actor another actor's module), small
scheduler-core files and no mixins.

Imports are read with `ast`, never executed: the module-level ones, those under
`if TYPE_CHECKING:` and those inside functions all count, for the layering (a lazy `import
trio` is still a dependency) and for cycles (a lazy import that closes a cycle still makes
two modules that cannot be understood apart).
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = "sluice.actors.scheduler"
# the core's package also holds the actor that drives it and the operator commands it answers;
# those two are its shell, with I/O and messages, and are held to none of the core's rules
SHELL = ("sluice.actors.scheduler.actor", "sluice.actors.scheduler.commands")
MAX_CORE_LINES = 420  # "about 400"
BANNED_IN_CORE = ("trio", "zmq", "torch", "socket", "ssl", "asyncio", "selectors", "msgpack")
# what the core may import from outside itself: the values it shares with the client protocol
SHARED_VOCABULARY = "sluice.ipc.vocabulary"


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    top: set[str] = field(default_factory=set)  # module level and under TYPE_CHECKING
    nested: set[str] = field(default_factory=set)  # inside functions and classes' methods

    @property
    def imports(self) -> set[str]:
        return self.top | self.nested


def _folders() -> dict[str, Path]:
    """`sluice.<folder>` -> folder, as pyproject.toml maps them."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in mapping.items()}


def _modules() -> dict[str, Module]:
    modules = {}
    for package, folder in _folders().items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([package, *parts])
            modules[name] = Module(name, path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(node: ast.Import | ast.ImportFrom, module: Module) -> list[str]:
    """Dotted names an import statement brings in: `from a import b` names the module a.b
    where there is one, else a (b is then a name defined in a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing package
        package = module.name.split(".")
        if not module.is_package:
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base]) if base else ".".join(package)
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
        for alias in node.names
    ]


def _collect(module: Module) -> None:
    tree = ast.parse(module.path.read_text(), filename=str(module.path))

    def visit(body: list[ast.stmt], nested: bool) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                (module.nested if nested else module.top).update(_imported_names(node, module))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(node.body, True)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, nested)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, nested)
                visit(node.orelse, nested)
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child], nested)
                    elif isinstance(child, ast.excepthandler):
                        visit(child.body, nested)

    visit(tree.body, False)


MODULES = _modules()
for _module in list(MODULES.values()):
    _collect(_module)


def _ours(names: set[str]) -> set[str]:
    return {name for name in names if name in MODULES}


def _externals(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names if not name.startswith("sluice")}


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _in_core(name: str) -> bool:
    return _under(name, CORE) and name not in SHELL


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(start: str) -> None:  # iterative Tarjan: no recursion limit to hit
        nonlocal counter
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    found.append(sorted(component))

    for name in sorted(edges):
        if name not in index:
            connect(name)
    return found


def test_the_source_is_found() -> None:
    assert f"{CORE}.scheduler" in MODULES and "sluice.ipc.messages" in MODULES
    assert "sluice.kernels" in MODULES and "sluice.tui.app" in MODULES
    assert "sluice.ipc.messages" in MODULES["sluice.ipc.codec"].top
    assert MODULES[f"{CORE}.scheduler"].top & MODULES.keys()


def test_no_import_cycle_among_our_modules() -> None:
    edges = {name: _ours(module.imports) - {name} for name, module in MODULES.items()}
    assert _cycles(edges) == []


def test_kernels_import_nothing_of_ours() -> None:
    for name, module in MODULES.items():
        if _under(name, "sluice.kernels"):
            outside = {i for i in _ours(module.imports) if not _under(i, "sluice.kernels")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_the_scheduler_core_has_no_io_and_no_actor() -> None:
    for name, module in MODULES.items():
        if not _in_core(name):
            continue
        banned = _externals(module.imports) & set(BANNED_IN_CORE)
        assert not banned, f"{name} imports {sorted(banned)}"
        outside = {
            i for i in _ours(module.imports) if not (_in_core(i) or i == SHARED_VOCABULARY)
        }
        assert not outside, f"{name} imports {sorted(outside)} from outside the core"


def test_the_shared_vocabulary_imports_nothing() -> None:
    """The one module both the core and `ipc/` may import stands on the standard library."""
    module = MODULES[SHARED_VOCABULARY]
    assert _ours(module.imports) == set()
    assert _externals(module.imports) <= {"__future__", "dataclasses", "enum", "functools", "json"}


def test_ipc_imports_no_actor_daemon_or_console() -> None:
    for name, module in MODULES.items():
        if _under(name, "sluice.ipc"):
            outside = {i for i in _ours(module.imports) if not _under(i, "sluice.ipc")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_the_console_imports_only_ipc_of_ours() -> None:
    for name, module in MODULES.items():
        if _under(name, "sluice.tui"):
            outside = {
                i
                for i in _ours(module.imports)
                if not (_under(i, "sluice.ipc") or _under(i, "sluice.tui"))
            }
            assert not outside, f"{name} imports {sorted(outside)}"


def test_no_file_of_the_scheduler_core_is_long() -> None:
    long = {
        name: lines
        for name, module in MODULES.items()
        if _in_core(name)
        and (lines := len(module.path.read_text().splitlines())) > MAX_CORE_LINES
    }
    assert long == {}


def _our_classes() -> dict[str, set[str]]:
    """Class name -> the modules defining a class of that name."""
    defined: dict[str, set[str]] = {}
    for name, module in MODULES.items():
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, set()).add(name)
    return defined


def _base_name(base: ast.expr) -> str:
    if isinstance(base, ast.Attribute):
        return base.attr
    if isinstance(base, ast.Subscript):
        return _base_name(base.value)
    return base.id if isinstance(base, ast.Name) else ""


def test_no_mixins() -> None:
    ours = _our_classes()
    problems = []
    for name, module in MODULES.items():
        for node in ast.walk(ast.parse(module.path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            if node.name.endswith("Mixin"):
                problems.append(f"{name}.{node.name} is a mixin")
            own_bases = [b for b in map(_base_name, node.bases) if b in ours]
            if len(own_bases) > 1:
                problems.append(f"{name}.{node.name} has bases {own_bases}")
    assert problems == []


# an actor may import the actor it starts and supervises: the Gateway a Stream per connection,
# the HTTP front the Stream its requests go through
SUPERVISES = {("sluice.actors.front.gateway", "sluice.actors.front.stream"),
              ("sluice.actors.http.front", "sluice.actors.front.stream")}


def _actor_modules() -> set[str]:
    """Modules that define an actor: a class whose base is `Actor`."""
    found = set()
    for name, module in MODULES.items():
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, ast.ClassDef) and "Actor" in map(_base_name, node.bases):
                found.add(name)
    return found


def test_no_actor_imports_another_actor_s_module() -> None:
    actors = _actor_modules()
    assert {"sluice.actors.front.gateway", "sluice.actors.scheduler.actor",
            "sluice.actors.text.actor", "sluice.actors.usage.actor"} <= actors
    crossing = sorted(
        f"{name} imports {other}"
        for name in actors
        for other in _ours(MODULES[name].imports) & actors
        if other != name and (name, other) not in SUPERVISES
    )
    assert crossing == []


def test_the_shared_vocabulary_is_imported_from_where_it_is_declared() -> None:
    """A name the vocabulary declares (`SamplingParams`, `InvalidParams`, `FinishReason`, ...)
    is imported from it, never through a module that happens to import it too: one import
    path each, in the package, its tests and its benchmarks."""
    tree = ast.parse(MODULES[SHARED_VOCABULARY].path.read_text())
    declared = {node.name for node in tree.body
                if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    assert {"SamplingParams", "InvalidParams"} <= declared
    sources = [module.path for module in MODULES.values()]
    sources += sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    elsewhere = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("sluice.") and node.module != SHARED_VOCABULARY):
                elsewhere += [f"{path.relative_to(ROOT)}: {alias.name} from {node.module}"
                              for alias in node.names if alias.name in declared]
    assert not elsewhere, elsewhere
