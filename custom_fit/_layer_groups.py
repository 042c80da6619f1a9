"""Which layer group each variable belongs to (inspection, layer clipping).

`TrainStepMixin.layer_names_of` names, for each variable, the entry of
`model.layers` that owns it, descending `layer_depth - 1` levels into
models used as layers (`"encoder/dense_1"`); with `layer_depth=None` (the
default), into every model at any depth, so that a group is a layer, never
a model (the model one wrapped, a keras-hub backbone, a Sequential
encoder).
"""

import weakref
from typing import Any

# model -> {(depth, ids and trainable flags of the variables, the names of
# the model and its layers): (the variables, their names)}.
# An eager step asks at every step; the variables are kept so that their
# ids stay theirs while the entry lives.
_NAMES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

# `layer_depth=None`: deeper than any model nests.
_EVERY_LEVEL = 2**31 - 1


def _levels(depth: int | None) -> int:
    """The levels of `model.layers` that a `layer_depth` groups by."""
    return _EVERY_LEVEL if depth is None else depth


def assign_owners(
    layer: Any, path: str, depth: int, owners: dict[int, str]
) -> None:
    """Names the group of each trainable variable of `layer`.

    See `TrainStepMixin.layer_names_of`: it descends `depth - 1` levels into
    models used as layers. A variable is read from `layer.variables`, not
    `layer.trainable_variables`, which is empty for a frozen layer even when
    a layer inside it trains (`enable_lora` freezes each transformer layer
    and unfreezes its query and value projections, whose LoRA kernels the
    model trains).
    """
    if depth > 1:
        for inner in getattr(layer, "layers", None) or ():
            assign_owners(inner, f"{path}/{inner.name}", depth - 1, owners)
    for variable in layer.variables:
        if variable.trainable:
            owners.setdefault(id(variable), path)


def group_names(model: Any, depth: int | None) -> list[str]:
    """Returns the name of every group of `model`, frozen layers included.

    The entries of `model.layers` and, with `depth` above 1, the layers
    nested in them down to `depth` levels (`"encoder/dense_1"`): the names
    `layer_names` gives a variable, whether or not the layer trains now.

    Args:
        model: The model (or a layer that has `layers`).
        depth: Integer or `None`, the `layer_depth` option.
    """
    depth = _levels(depth)
    names = []
    for layer in model.layers:
        names.append(layer.name)
        if depth > 1 and getattr(layer, "layers", None):
            names += [
                f"{layer.name}/{inner}"
                for inner in group_names(layer, depth - 1)
            ]
    return names


def _names_within(model: Any, depth: int) -> tuple:
    """Returns the names the group names are made of.

    Those of `model.layers`, and of the layers inside them down to `depth`
    levels.
    """
    return tuple(
        (layer.name, _names_within(layer, depth - 1))
        if depth > 1 and getattr(layer, "layers", None)
        else layer.name
        for layer in model.layers
    )


def layer_names(model: Any, variables: Any, depth: int | None) -> list[str]:
    """Returns, for each variable, the name of the group that owns it.

    Args:
        model: The model.
        variables: List of variables of the model.
        depth: Integer or `None`, the `layer_depth` option.

    Returns:
        A list of group names aligned with `variables`; a variable that no
        entry of `model.layers` owns gets the model's name.
    """
    depth = _levels(depth)
    variables = list(variables)
    # Freezing a layer changes which of its variables it owns here, and a
    # renamed layer names its group anew.
    key = (
        depth,
        tuple((id(v), bool(v.trainable)) for v in variables),
        model.name,
        _names_within(model, depth),
    )
    known = _NAMES.setdefault(model, {})
    if key not in known:
        owners: dict[int, str] = {}
        for layer in model.layers:
            assign_owners(layer, layer.name, depth, owners)
        names = [owners.get(id(v), model.name) for v in variables]
        known[key] = (variables, names)
    return list(known[key][1])
