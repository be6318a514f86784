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
