"""The package layout of ``src/remat`` holds: no import cycles, no reaching into another package's privates.

Read from the source with :mod:`ast`, so every import counts: those at the top of a module and
those deferred into a function body alike (a deferred import still ties the two modules
together; it only hides the cycle from the interpreter until the function runs). Nothing is
imported or executed.

Rules, as STYLE.md states them:

- No cycle between modules. An edge runs from a module to each ``remat`` module it names in an
  ``import``/``from ... import`` statement (``from package import submodule`` is an edge to the
  submodule). Entering a package to reach one of its modules runs the package's ``__init__``;
  that is not counted as an edge, since a package's ``__init__`` may gather its own modules.
- Within one package, modules share private modules and names freely. Across a package
  boundary, a module imports no private module (``remat.profiling._fake``), no private name
  (``from remat.planner import _allowed``) and reads no private attribute of a ``remat`` module it
  imported (``patches._registry``): the package's ``__init__`` names what others use.
- Imports run downward through :data:`LAYERS`, the order the README's architecture section
  draws: a subpackage or top-level module imports only those in layers below its own.

A module's package is the package that directly contains it (``remat`` for ``remat/api.py``,
``remat.treat`` for ``remat/treat/patches.py``); a package's ``__init__`` belongs to the package
itself.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
SOURCE = REPOSITORY / "src"
ROOT = "remat"

LAYERS = (
    ("remat.cli",),                                  # one module per command
    ("remat.prove",),                                # the bench harness, reports, demo
    ("remat.integrations",),                         # Trainer / TRL / Lightning callbacks, the collector
    ("remat.diagnosis",),                            # the doctor
    ("remat",),                                      # the public names, resolved lazily
    ("remat.guard",),                                # remat.Guard: re-plans around the training step
    ("remat.planner",),                              # remat.plan / remat.auto: profile, solve, verify
    ("remat.api", "remat.profiling"),                # apply / remove; measuring a model
    ("remat.head",),                                 # the chunked LM head: op, kernels, HF glue, patching
    ("remat.treat",),                                # the patch registry, discovery, block treatments
    ("remat.offload", "remat.parallel"),             # the offload engine; context parallelism
    ("remat.planning", "remat.presets"),             # pure plans, costs, simulator, solver; model configs
    ("remat.units", "remat.caches"),                 # sizes and budgets; the process caches' registry
)
"""Top to bottom: each entry's modules import only entries below it (``remat`` is the root ``__init__``)."""


@dataclass(frozen=True)
class Import:
    """One reference from a module to a ``remat`` module, or to a name or attribute of one."""

    importer: str
    line: int
    module: str
    """The ``remat`` module referred to (a package's ``__init__`` under the package's name)."""
    name: str = ""
    """The name taken from ``module`` (``from module import name``, or ``alias.name``), if any."""

    def __str__(self):
        what = f"{self.module}.{self.name}" if self.name else self.module
        return f"{self.importer}:{self.line} -> {what}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def find_modules(source: Path = SOURCE) -> dict:
    """``{dotted module name: path}`` of every module under ``source/remat``."""
    found = {}
    for path in sorted((source / ROOT).rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def package_of(module: str, modules: dict) -> str:
    """The package ``module`` belongs to: itself for a package, else the package containing it."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def _absolute(importer: str, modules: dict, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    base = package_of(importer, modules).split(".")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


_NAMED_BY_STRING = {"import_module": 0, "__import__": 0}  # a function that takes a module's name: its argument
_ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _resolve(dotted: str, modules: dict):
    """``(module, rest)``: the longest ``remat`` module ``dotted`` starts with, and the names after it."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end]), parts[end:]
    return None, parts


def references(importer: str, modules: dict) -> list:
    """Every :class:`Import` written in ``importer``'s source, at any depth of the module.

    Statements (``import``, ``from ... import``), and the dynamic forms that reach a module or a
    name by string or by attribute: ``importlib.import_module("remat.x")`` (relative with a
    constant package or ``__name__``), ``__import__("remat.x")``, ``sys.modules["remat.x"]`` and
    ``sys.modules.get("remat.x")``, ``getattr(module, "_name")`` (and ``hasattr``/``setattr``/
    ``delattr``) on an imported ``remat`` module, and dotted reads through an imported module
    (``remat.x._y.z`` after ``import remat.x``: an edge to ``remat.x._y``)."""
    tree = ast.parse(modules[importer].read_text(), filename=str(modules[importer]))
    found, aliases = [], {}

    def named(line, dotted):
        module, rest = _resolve(dotted, modules)
        if module is not None:
            found.append(Import(importer, line, module, rest[0] if rest else ""))

    def module_of(node):
        """The ``remat`` module an expression names (an alias, or dotted through one), with its
        line's private attribute if one is read on the way; None if it names none."""
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in aliases:
            return None, []
        module = aliases[node.id]
        while chain and f"{module}.{chain[0]}" in modules:
            module = f"{module}.{chain.pop(0)}"
        return module, chain

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.append(Import(importer, node.lineno, alias.name))
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    elif alias.name.split(".")[0] == ROOT:  # ``import remat.x`` binds ``remat``
                        aliases[ROOT] = ROOT
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(importer, modules, node.level, node.module)
            if source not in modules:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.append(Import(importer, node.lineno, submodule))
                    aliases[alias.asname or alias.name] = submodule
                else:
                    found.append(Import(importer, node.lineno, source, alias.name))
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # each dotted read once, whole
            module, chain = module_of(node)
            if module is None:
                continue
            private = chain[0] if chain and is_private(chain[0]) else ""
            if module != aliases[_base(node).id] or private:  # through the alias into a submodule, or a private name
                found.append(Import(importer, node.lineno, module, private))
        elif isinstance(node, ast.Call):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            strings = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None for a in node.args]
            if function in _NAMED_BY_STRING and strings and strings[0] is not None:
                name = _absolute_name(strings[0], node.args[1:], importer, modules)
                if name is not None:
                    named(node.lineno, name)
            elif function in _ATTRIBUTE_FUNCTIONS and len(strings) >= 2 and strings[1] is not None:
                module, chain = module_of(node.args[0])
                if module is None or chain:
                    continue
                if f"{module}.{strings[1]}" in modules:
                    found.append(Import(importer, node.lineno, f"{module}.{strings[1]}"))
                elif is_private(strings[1]):
                    found.append(Import(importer, node.lineno, module, strings[1]))
            elif function == "get" and isinstance(node.func, ast.Attribute) and _is_sys_modules(node.func.value) \
                    and strings and strings[0] is not None:
                named(node.lineno, strings[0])
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            named(node.lineno, node.slice.value)
    return found


def _absolute_name(name: str, rest: list, importer: str, modules: dict):
    """The absolute module name ``import_module(name, package)`` imports, written in ``importer``
    (None for a relative name whose package is not a constant, ``__name__`` or ``__package__``)."""
    if not name.startswith("."):
        return name
    package = rest[0] if rest else None
    if isinstance(package, ast.Constant) and isinstance(package.value, str):
        base = package.value
    elif isinstance(package, ast.Name) and package.id in ("__name__", "__package__"):
        base = importer if package.id == "__name__" else package_of(importer, modules)
    else:
        return None
    level = len(name) - len(name.lstrip("."))
    parts = base.split(".")
    return ".".join(parts[:len(parts) - (level - 1)] + ([name.lstrip(".")] if name.lstrip(".") else []))


def _base(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _is_sys_modules(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def import_graph(modules: dict) -> dict:
    """``{module: {modules it imports}}``."""
    return {name: {ref.module for ref in references(name, modules) if ref.module != name} for name in modules}


def cycles(graph: dict) -> list:
    """The strongly connected components of ``graph`` with more than one module (Tarjan), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_of(module: str) -> str:
    """The entry of :data:`LAYERS` a module belongs to: its subpackage of ``remat``, or itself."""
    return ".".join(module.split(".")[:2])


def upward_imports(modules: dict, layers=LAYERS) -> list:
    """Each import that does not run down :data:`LAYERS` (or names a part of ``remat`` not in them)."""
    rank = {name: index for index, layer in enumerate(layers) for name in layer}
    found = []
    for importer in modules:
        for ref in references(importer, modules):
            here, there = layer_of(importer), layer_of(ref.module)
            if here != there and not rank.get(here, -1) < rank.get(there, -1):
                found.append(f"{ref} ({here} -> {there})")
    return found


def private_crossings(modules: dict) -> list:
    """Each reference from one package into another package's private module or private name."""
    found = []
    for importer in modules:
        here = package_of(importer, modules)
        for ref in references(importer, modules):
            there = package_of(ref.module, modules)
            if there == here:
                continue
            inside = ref.module[len(there):].split(".")  # the module's own name, "" for a package
            if any(is_private(part) for part in inside) or is_private(ref.name):
                found.append(str(ref))
    return found


_NEVER = re.compile(r"never imports?\b(.*?)(?:\.\s|\.$|;|:\s)", re.S)
_MODULE_REFERENCE = re.compile(r":mod:`~?(remat(?:\.\w+)*)`")


def never_imports(package: str, modules: dict) -> tuple:
    """The modules ``package``'s ``__init__`` docstring says it must never import: each
    ``:mod:`remat...``` reference written after "never import(s)", to the end of that sentence
    (a full stop, a semicolon or a colon ends it). Empty where it states none, or where the
    sentence names no module ("... which never imports this package": another package's rule)."""
    doc = ast.get_docstring(ast.parse(modules[package].read_text())) or ""
    return tuple(name for segment in _NEVER.findall(doc) for name in _MODULE_REFERENCE.findall(segment))


def members(package: str, modules: dict) -> list:
    """The modules of ``package``: its ``__init__`` and every module under it (the root: its own modules)."""
    if package == ROOT:
        return [m for m in modules if package_of(m, modules) == ROOT]
    return [m for m in modules if m == package or m.startswith(package + ".")]


def forbidden_imports(modules: dict) -> list:
    """Each reference from a package's module to a module its package's docstring says it never imports."""
    found = []
    for package in (m for m in modules if modules[m].name == "__init__.py"):
        listed = never_imports(package, modules)
        for importer in members(package, modules) if listed else ():
            for ref in references(importer, modules):
                banned = next((b for b in listed if ref.module == b or ref.module.startswith(b + ".")), None)
                if banned is not None:
                    found.append(f"{ref} ({package} never imports {banned})")
    return found


def test_no_import_cycles():
    assert cycles(import_graph(find_modules())) == []


def test_no_package_imports_another_packages_private_modules_or_names():
    assert private_crossings(find_modules()) == []


def test_imports_run_down_the_layers():
    modules = find_modules()
    assert {layer_of(m) for m in modules} == {name for layer in LAYERS for name in layer}
    assert upward_imports(modules) == []


def test_the_scan_sees_deferred_imports_cycles_and_private_crossings(tmp_path):
    package = tmp_path / ROOT
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("from remat.low._impl import helper\n")
    (package / "low" / "_impl.py").write_text("def helper():\n    from remat import top\n")
    (package / "low" / "user.py").write_text("from remat.low import _impl\n")  # a sibling: allowed
    (package / "top.py").write_text("from remat.low import helper\nfrom remat.low._impl import helper\n"
                                    "import remat.low.user as user\nuser._hidden\n")
    modules = find_modules(tmp_path)
    assert cycles(import_graph(modules)) == [["remat.low", "remat.low._impl", "remat.low.user", "remat.top"]]
    assert private_crossings(modules) == ["remat.top:2 -> remat.low._impl.helper", "remat.top:4 -> remat.low.user._hidden"]
    assert upward_imports(modules, layers=(("remat.top",), ("remat.low",))) == [
        "remat.low._impl:2 -> remat.top (remat.low -> remat.top)"]


def test_the_scan_sees_dynamic_imports_and_dotted_private_reads(tmp_path):
    """Each form that reaches another package's private module or name without an import of it."""
    package = tmp_path / ROOT
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "_impl.py").write_text("helper = 1\n")
    (package / "top.py").write_text(
        "import importlib\nimport sys\nimport remat.low\nfrom remat import low\n"
        "importlib.import_module('remat.low._impl')\n"   # 5
        "importlib.import_module('._impl', 'remat.low')\n"  # 6
        "sys.modules['remat.low._impl']\n"               # 7
        "sys.modules.get('remat.low._impl')\n"           # 8
        "getattr(low, '_hidden')\n"                       # 9
        "remat.low._impl.helper\n"                        # 10
        "getattr(low, 'public'), low.public, remat.low.public\n")  # 11: public, allowed
    modules = find_modules(tmp_path)
    assert private_crossings(modules) == [f"remat.top:{line} -> remat.low._impl" for line in (5, 6, 7, 8)] + [
        "remat.top:9 -> remat.low._hidden", "remat.top:10 -> remat.low._impl"]


def test_the_scan_holds_a_package_to_the_modules_its_docstring_never_imports(tmp_path):
    package = tmp_path / ROOT
    for name in ("low", "mid"):
        (package / name).mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "tools.py").write_text("helper = 1\n")
    (package / "mid" / "__init__.py").write_text(
        '"""Middle. It must never import :mod:`remat.low.tools` or :mod:`remat.other`: they sit aside."""\n')
    (package / "mid" / "user.py").write_text("import importlib\n\ndef f():\n"
                                              "    from remat.low import tools\n"
                                              "    importlib.import_module('remat.low')\n")
    modules = find_modules(tmp_path)
    assert never_imports("remat.mid", modules) == ("remat.low.tools", "remat.other")
    assert forbidden_imports(modules) == ["remat.mid.user:4 -> remat.low.tools (remat.mid never imports remat.low.tools)"]


def readme_layers() -> tuple:
    """:data:`LAYERS` as the README's architecture section draws them: one entry a line of its
    ``src/remat/`` listing, top to bottom, an entry marked "beside" in the layer above it."""
    text = (REPOSITORY / "README.md").read_text().split("\n## Architecture\n", 1)[1]
    listing = re.search(r"```\nsrc/remat/\n(.*?)```", text, re.S).group(1)
    layers = []
    for line in listing.splitlines():
        entry = re.match(r"  (\w+)(/|\.py)\s+(beside)?", line)
        if entry is None:
            continue
        name = ROOT if entry[1] == "__init__" else f"{ROOT}.{entry[1]}"
        if entry[3]:
            layers[-1] += (name,)
        else:
            layers.append((name,))
    return tuple(layers)


def test_the_readme_draws_the_layers_this_test_checks():
    assert readme_layers() == LAYERS


@pytest.mark.parametrize("package", ["remat.head", "remat.diagnosis", "remat.profiling"])
def test_a_package_says_what_it_holds_and_what_it_never_imports(package):
    modules = find_modules()
    listed = never_imports(package, modules)
    assert listed, f"{package}'s docstring names no module after 'never import' (write them as :mod:`remat.x`)"
    assert [name for name in listed if name not in modules] == []  # each names a module that exists


def test_no_package_imports_what_its_docstring_says_it_never_imports():
    assert forbidden_imports(find_modules()) == []
