"""The generated parts of the architecture page (docs/architecture.md).

The page is prose with two marker lines, each replaced at build time
(`docs/gen_architecture.py`, run by mkdocs-gen-files) by a table made here
from the sources, read with `ast` (nothing is imported):

- `<!-- generated: modules -->`: every module of the package on its floor,
  with the first line of its docstring;
- `<!-- generated: contract -->`: every function of the backend contract
  (`custom_fit/backend/_contract.py`'s `Adapter`), its arguments and the
  first line of its docstring.

`tests/architecture_test.py` renders the page the same way and checks that
every module and every contract function is on it.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "custom_fit"
CONTRACT = PACKAGE / "backend" / "_contract.py"
PAGE = ROOT / "docs" / "architecture.md"
MODULES_MARKER = "<!-- generated: modules -->"
CONTRACT_MARKER = "<!-- generated: contract -->"

# The floors, top to bottom: a module's floor follows from its path.
FLOORS = (
    ("Mixins", "what a model's class statement lists: options and hooks"),
    ("Public tools", "pure functions, callbacks, samplers, options"),
    ("Machinery", "the backend-neutral core's private rooms"),
    ("Backend seam", "one adapter per backend, and what adapters share"),
)


def floor_of(path):
    """Returns the floor of the module at `path` (a `pathlib.Path`)."""
    relative = path.relative_to(PACKAGE)
    if relative.parts[0] == "backend":
        return "Backend seam"
    if path.name.endswith("_mixin.py"):
        return "Mixins"
    if path.name.startswith("_") and path.name != "__init__.py":
        return "Machinery"
    return "Public tools"


def modules():
    """Returns `(dotted name, path, summary)` of every module, sorted."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        parts = relative.parts[:-1] if path.name == "__init__.py" else (
            relative.parts
        )
        docstring = ast.get_docstring(ast.parse(path.read_text("utf-8")))
        summary = docstring.splitlines()[0] if docstring else ""
        found.append((".".join(parts), path, summary))
    return found


def contract():
    """Returns `(name, arguments, summary)` of each `Adapter` function."""
    tree = ast.parse(CONTRACT.read_text("utf-8"))
    adapter = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "Adapter"
    )
    found = []
    for node in adapter.body:
        if isinstance(node, ast.FunctionDef):
            arguments = [a.arg for a in node.args.args if a.arg != "self"]
            docstring = ast.get_docstring(node) or ""
            summary = docstring.splitlines()[0] if docstring else ""
            found.append((node.name, arguments, summary))
    return found


def _cell(text):
    return text.replace("|", "\\|")


def modules_table():
    """The modules, floor by floor, as Markdown."""
    lines = []
    for floor, meaning in FLOORS:
        rows = [m for m in modules() if floor_of(m[1]) == floor]
        lines += [
            f"**{floor}** ({meaning}): {len(rows)} modules.",
            "",
            "| module | what it holds |",
            "|---|---|",
        ]
        for name, path, summary in rows:
            source = path.relative_to(ROOT).as_posix()
            lines.append(f"| `{name}` (`{source}`) | {_cell(summary)} |")
        lines.append("")
    return "\n".join(lines)


def contract_table():
    """The backend contract as Markdown."""
    lines = ["| function | arguments | what it does |", "|---|---|---|"]
    for name, arguments, summary in contract():
        shown = ", ".join(f"`{a}`" for a in arguments) or "-"
        lines.append(f"| `{name}` | {shown} | {_cell(summary)} |")
    return "\n".join(lines) + "\n"


def render(text=None):
    """Returns the page with its markers replaced by the tables."""
    text = PAGE.read_text("utf-8") if text is None else text
    for marker in (MODULES_MARKER, CONTRACT_MARKER):
        if text.count(marker) != 1:
            raise ValueError(
                f"docs/architecture.md must hold the line {marker!r} once. "
                f"Received: {text.count(marker)} of them."
            )
    text = text.replace(MODULES_MARKER, modules_table())
    return text.replace(CONTRACT_MARKER, contract_table())
