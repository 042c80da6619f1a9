"""Writes the API reference: one page per public symbol of custom_fit.

Run by mkdocs-gen-files at build time. The public symbols are those of
`custom_fit.__all__`: each class is a page; each module is a page listing
the names of its own `__all__` (which every public module has), with a
page for each of them, and nothing else. Found by griffe's static analysis
of the sources: nothing is imported.
"""

import griffe
import mkdocs_gen_files

package = griffe.load("custom_fit", search_paths=["."])
nav = mkdocs_gen_files.Nav()


def public_names(module):
    """The names a public module exports: its `__all__`."""
    if module.exports is None:
        raise SystemExit(
            f"{module.path} has no __all__: a public module lists its public "
            "names, and only those get pages."
        )
    return [str(name) for name in module.exports]


def named_module(module):
    """The module a public module's page documents.

    An earlier path of a module that moved (`custom_fit.sampling` names
    `custom_fit.privacy.sampling`) imports it as `_module`: its page
    documents that module, under the earlier path's name.
    """
    alias = module.members.get("_module")
    if alias is not None and alias.is_alias:
        return alias.final_target
    return module


# The bases `TrainStepMixin` is made of, by concern, whose public methods
# are its own (`minimize`, `report_metric`, ...): its page lists them.
TRAIN_STEP_BASES = (
    "custom_fit._steps.Steps",
    "custom_fit._configuring.Configured",
    "custom_fit._update.Minimizing",
    "custom_fit._figures.SharedFigures",
    "custom_fit._reporting.Reporting",
)


def public_methods(paths):
    """The public functions of the classes at `paths`, in source order.

    Each must still be a base of `TrainStepMixin`: a base renamed or
    dropped stops the build instead of leaving its methods off the page.
    """
    bases = {
        str(base).rsplit(".", 1)[-1]
        for base in package["train_step_mixin"]["TrainStepMixin"].bases
    }
    for path in paths:
        if path.rsplit(".", 1)[-1] not in bases:
            raise SystemExit(
                f"{path} is no base of TrainStepMixin: update "
                "TRAIN_STEP_BASES in docs/gen_api.py."
            )
    names = []
    for path in paths:
        members = package[path.removeprefix("custom_fit.")].members
        names.extend(
            name
            for name, member in members.items()
            if member.is_function and not name.startswith("_")
        )
    return names


def write(path, identifier, children=(), signature=True, inherited=()):
    """Writes `api/<path>.md`: the symbol's docstring, and its children.

    A mixin's signature is left out: its constructor takes `*args,
    **kwargs` (Keras' model arguments) and its options, which its Args
    list (`help()` shows them in the signature). `inherited` names the
    methods of its bases the page lists as its own.
    """
    options = []
    if not signature:
        options.append("show_signature: false")
    if children:
        options.append("members: false")
    if inherited:
        options.append(f"inherited_members: {list(inherited)}")
    with mkdocs_gen_files.open(f"api/{path}.md", "w") as page:
        page.write(f"::: {identifier}\n")
        if options:
            page.write("    options:\n")
            page.writelines(f"      {option}\n" for option in options)
            page.write("\n")
        if children:
            page.write("| name | summary |\n|---|---|\n")
            for name, summary in children:
                page.write(f"| [`{name}`]({path}.{name}.md) | {summary} |\n")


def summary(member):
    """The first line of a member's docstring, for a table cell."""
    text = member.docstring.value if member.docstring else ""
    return text.splitlines()[0].replace("|", "\\|") if text else ""


for name in package.exports:
    member = package.members[str(name)]
    target = member.final_target if member.is_alias else member
    identifier = f"custom_fit.{name}"
    if target.is_module:
        target = named_module(target)
        children = []
        for child in public_names(target):
            child_member = target.members[child]
            child_target = (
                child_member.final_target
                if child_member.is_alias
                else child_member
            )
            children.append((child, summary(child_target)))
            write(f"{identifier}.{child}", f"{target.path}.{child}")
            nav[(identifier, child)] = f"{identifier}.{child}.md"
        write(identifier, target.path, children)
        nav[(identifier,)] = f"{identifier}.md"
    else:
        mixin = (
            target.is_class
            and any("TrainStepMixin" in str(base) for base in target.bases)
            or str(name) == "TrainStepMixin"
        )
        inherited = (
            public_methods(TRAIN_STEP_BASES)
            if str(name) == "TrainStepMixin"
            else ()
        )
        write(identifier, identifier, signature=not mixin, inherited=inherited)
        nav[(identifier,)] = f"{identifier}.md"

with mkdocs_gen_files.open("api/index.md", "w") as index:
    index.write(
        "# API reference\n\nEvery public name of custom_fit, one page each, "
        "from its docstring.\n\n"
    )
    for name in package.exports:
        index.write(f"- [`custom_fit.{name}`](custom_fit.{name}.md)\n")

with mkdocs_gen_files.open("api/SUMMARY.md", "w") as summary_file:
    summary_file.write("* [Overview](index.md)\n")
    summary_file.writelines(nav.build_literate_nav())
