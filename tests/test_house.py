"""House rules the code keeps: short functions, and schedules that read hardware facts from the plan."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONGEST = 80  # lines a function may span, its docstring and decorators included


def _sources(*folders: str) -> list:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, start, node.end_lineno - start + 1


def test_no_function_is_longer_than_80_lines():
    long = [f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
            for path in _sources("tvm_stitch", "schedules") for name, line, length in _functions(path)
            if length > LONGEST]
    assert not long, "\n".join(long)


def _hardware_reads(path: pathlib.Path) -> list:
    """Calls of TargetSpec.from_target and reads of a target's attrs in `path`: (line, what)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "from_target":
            found.append((node.lineno, "from_target"))
        if (isinstance(node, ast.Attribute) and node.attr == "attrs" and isinstance(node.value, ast.Name)
                and "target" in node.value.id):
            found.append((node.lineno, f"{node.value.id}.attrs"))
    return found


def test_schedules_take_hardware_facts_from_the_plan_spec():
    found = [f"{path.relative_to(ROOT)}:{line} {what}" for path in _sources("schedules")
             for line, what in _hardware_reads(path)]
    assert not found, "\n".join(found)


def test_the_checks_see_what_they_forbid(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(target):\n    return TargetSpec.from_target(target), target.attrs['x']\n"
                   + "def g():\n" + "    x = 1\n" * LONGEST)
    assert _hardware_reads(bad) == [(2, "from_target"), (2, "target.attrs")]
    assert [(name, length) for name, _, length in _functions(bad)] == [("f", 2), ("g", LONGEST + 1)]


def _module_imports(path: pathlib.Path) -> list:
    """(line, imported module, at the top level) of each tvm_stitch/schedules import in `path`; `from pkg
    import name` counts as `pkg.name` where that is a module, else as `pkg`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if _module_path(f"{node.module}.{a.name}") else node.module
                     for a in node.names]
        found += [(node.lineno, n, id(node) in top) for n in names if n.split(".")[0] in ("tvm_stitch", "schedules")]
    return found


def _module_path(module: str):
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(paths: list) -> dict:
    return {_module_name(p): {m for _, m, _ in _module_imports(p) if _module_path(m)} for p in paths}


def _cycle(graph: dict) -> list:
    """One import circle of `graph` (module -> modules it imports), or []."""
    state = {}

    def visit(module, stack):
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                return stack[stack.index(other):] + [other]
            if other not in state:
                found = visit(other, stack + [other])
                if found:
                    return found
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return []


def _core() -> list:
    return [p for p in _sources("tvm_stitch", "schedules")
            if not any(part in ("tools", "simt") for part in p.relative_to(ROOT).parts) and p.name != "__main__.py"]


def test_no_import_circle():
    graph = _graph(_sources("tvm_stitch", "schedules"))
    assert not _cycle(graph), " -> ".join(_cycle(graph))


def test_the_circle_check_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_the_compile_path_imports_neither_the_checker_nor_the_tools():
    graph = _graph(_core())
    seen, stack = set(), ["tvm_stitch", "tvm_stitch.pipeline", "tvm_stitch.explain"]
    while stack:
        module = stack.pop()
        if module not in seen:
            seen.add(module)
            stack.extend(graph.get(module, ()))
    assert not [m for m in seen if m.startswith(("tvm_stitch.simt", "tvm_stitch.tools"))], sorted(seen)


def test_the_compile_path_imports_at_the_top_or_says_why():
    """A function-level import on the compile path carries a comment on its line or the line above."""
    unexplained = []
    for path in _core():
        lines = path.read_text().splitlines()
        for line, module, at_top in _module_imports(path):
            said = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
            if not at_top and not said:
                unexplained.append(f"{path.relative_to(ROOT)}:{line} {module}")
    assert not unexplained, "\n".join(unexplained)


def test_no_file_of_the_package_is_over_500_lines_outside_the_tools():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in _sources("tvm_stitch")
            if "tools" not in p.relative_to(ROOT).parts and (n := len(p.read_text().splitlines())) > 500]
    assert not long, "\n".join(long)


def test_the_pass_classes_are_each_under_200_lines():
    long = []
    for path in _sources("tvm_stitch/stitch"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 >= 200:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_schedules_import_only_the_plan_and_analysis_parts():
    allowed = ("schedules", "tvm_stitch.planning", "tvm_stitch.analysis")
    found = [f"{p.relative_to(ROOT)}: {m}" for p in _sources("schedules") for _, m, _ in _module_imports(p)
             if not m.startswith(allowed)]
    assert not found, "\n".join(found)
