"""The shape of the code: which package may import which, no import circles, and the README's
map of the repository naming exactly what is there."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cute_ep", "kernels", "layouts")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports, at module level or inside functions."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from a import b` imports module a.b when there is one, else a's name b.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules and n != me}
    return found


GRAPH = {name: imports_of(path, project_modules()) for name, path in project_modules().items()}


def test_the_graph_sees_the_known_edges():
    # A broken parser would find no edges and pass every test below.
    assert "cute_ep.runtime.launch" in GRAPH["cute_ep.silu"]
    assert "layouts.abi" in GRAPH["kernels.silu"]
    assert "cute_ep.torch_ops" in GRAPH["cute_ep.ep"]
    assert "cute_ep.reference.fp4" in GRAPH["cute_ep.reference.silu"]


def test_no_module_imports_one_that_imports_it_back():
    # Tarjan-free: a module is on a circle when it can reach itself.
    def reach(start):
        seen, todo = set(), list(GRAPH[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(GRAPH[m])
        return seen

    circles = sorted(m for m in GRAPH if m in reach(m))
    assert not circles, f"modules on an import circle: {circles}"


@pytest.mark.parametrize("package,allowed", [
    ("layouts", ("layouts",)),
    ("kernels", ("kernels", "layouts")),
    ("cute_ep", ("cute_ep", "layouts", "kernels")),
])
def test_floors_import_only_the_floors_below(package, allowed):
    for name, deps in GRAPH.items():
        if name.split(".")[0] == package:
            bad = {d for d in deps if d.split(".")[0] not in allowed}
            assert not bad, f"{name} imports {bad}"
    if package == "cute_ep":  # only the build command and the demo's build step reach kernels/
        users = {n for n, deps in GRAPH.items() if n.startswith("cute_ep")
                 and any(d.startswith("kernels") for d in deps)}
        assert users <= {"cute_ep.tools.cli", "cute_ep.tools.demo"}, users


def test_the_abi_loads_nothing_but_layouts():
    code = ("import sys, layouts.abi; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'cutlass', 'cuda', 'cute_ep', 'kernels', 'numpy'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_readme_maps_every_package_and_module():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout of the repository", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = set()
    for row in rows:
        first, what = row.split("|")[1:3]
        path = first.strip().strip("`")
        assert (ROOT / path).exists(), f"the README's map names {path}, which is not there"
        folder = path if path.endswith("/") else ""
        for module in re.findall(r"`([\w/]+\.py)`", what):
            full = module if "/" in module else folder + module
            assert (ROOT / full).is_file(), f"the README's map names {full}, which is not there"
            named.add(full)
        named.add(path)
    packages = {f"{p.parent.relative_to(ROOT)}/" for pkg in PACKAGES
                for p in (ROOT / pkg).rglob("__init__.py")}
    assert packages <= named, f"packages missing from the README's map: {packages - named}"
    modules = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
               if p.name != "__init__.py"}
    assert modules <= named, f"modules missing from the README's map: {sorted(modules - named)}"


def _selected_families(tree) -> dict[str, str]:
    """`self.k_x = rt.select("family", ...)` assignments: attribute -> family."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            calls = [c for c in ast.walk(node.value) if isinstance(c, ast.Call)
                     and isinstance(c.func, ast.Attribute) and c.func.attr == "select"]
            if calls and isinstance(calls[0].args[0], ast.Constant):
                found[node.targets[0].attr] = calls[0].args[0].value
    return found


def _names_of(node, module, function) -> tuple[str, ...]:
    """The strings of a tuple literal, or of the module-level tuple a Name refers to."""
    if isinstance(node, ast.Name):
        for top in module.body:
            if isinstance(top, ast.Assign) and getattr(top.targets[0], "id", None) == node.id:
                node = top.value
                break
    assert isinstance(node, ast.Tuple), ast.dump(node)
    return tuple(e.value for e in node.elts)


def _keywords_of(call, function) -> set[str]:
    """A call's keyword names, `**d` resolved through `d = dict(...)` in the same function (and
    that call's own `**`s the same way)."""
    names = set()
    for kw in call.keywords:
        if kw.arg is not None:
            names.add(kw.arg)
            continue
        assigned = [n.value for n in ast.walk(function) if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", None) == kw.value.id]
        assert assigned and isinstance(assigned[0], ast.Call), kw.value.id
        names |= _keywords_of(assigned[0], function)
    return names


@pytest.mark.build
def test_every_bound_launch_names_each_parameter_of_its_kernel_once():
    """A Buffer binds its kernels' arguments once (`Kernel.bind(varying, **constants)`) and a
    launch then writes only the varying ones, unchecked; a parameter that is missing, named
    twice or misspelt is only caught when the bind runs on a GPU, so here it is caught without
    one, against the parameter lists the build compiles."""
    from kernels.matrix import full_matrix

    params = {}
    for kernel in full_matrix():
        spec = kernel.spec()
        params.setdefault(spec.family, set()).add(tuple(p.name for p in spec.params))
    binds = 0
    for path in (ROOT / "cute_ep").rglob("*.py"):
        module = ast.parse(path.read_text())
        families = _selected_families(module)
        for function in ast.walk(module):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "bind"
                        and isinstance(node.func.value, ast.Attribute)
                        and node.func.value.attr in families):
                    continue
                family = families[node.func.value.attr]
                varying = _names_of(node.args[0], module, function)
                constants = _keywords_of(node, function)
                for names in params[family]:
                    assert not set(varying) & constants, (path.name, node.lineno)
                    assert sorted(varying + tuple(constants)) == sorted(names), \
                        f"{path.name}:{node.lineno}: {family} declares {sorted(names)}; the " \
                        f"bind gives {sorted(varying)} varying and {sorted(constants)} fixed"
                binds += 1
    assert binds >= 3  # encode, dispatch, combine


def test_benchmarks_run_without_the_dsl():
    """perf/ runs on GPU machines that have torch and a built library but not the CuTe DSL: no
    script there imports kernels/ (whose modules import the DSL); what one needs of a kernel's
    constants comes from layouts/."""
    modules = project_modules()
    for path in sorted((ROOT / "perf").glob("*.py")):
        found = {m for m in imports_of(path, modules) if m.split(".")[0] == "kernels"}
        assert not found, f"perf/{path.name} imports {sorted(found)}"


# What a test file reads of the source tree: perf/'s tools and records, the README, docs/.
READS_SOURCE_TREE = ('sys.path.insert(0, "perf")', '/ "perf"', '"perf/', "README.md", '/ "docs"',
                     '"docs/')


def test_every_test_file_that_reads_the_source_tree_is_marked_so():
    """A test file that loads perf/, the README or docs/ carries a `pytestmark` naming
    `pytest.mark.source_tree`, so the installed wheel's test run, away from the tree, leaves it
    out (tests/conftest.py) instead of failing to import it or to find its files."""
    from tests.conftest import reads_source_tree

    unmarked = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("test_*.py"))
                if any(s in p.read_text() for s in READS_SOURCE_TREE) and not reads_source_tree(p)]
    assert not unmarked, f"read the source tree without pytest.mark.source_tree: {unmarked}"


def test_away_from_the_tree_the_marked_files_are_not_collected(tmp_path):
    """The wheel's test run (.ci/run): tests/ and pyproject.toml copied elsewhere. Collection
    succeeds, leaves out exactly the files marked source_tree, says so, and keeps the rest."""
    import shutil

    from tests.conftest import reads_source_tree

    shutil.copytree(ROOT / "tests", tmp_path / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if reads_source_tree(p)}
    assert marked and not files & marked, sorted(files & marked)
    assert {"tests/test_carve.py", "tests/test_reference.py"} <= files
    assert f"{len(marked)} files marked source_tree not collected" in run.stdout
