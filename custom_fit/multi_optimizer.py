"""`MultiOptimizer`: one optimizer per group of layers."""

from collections.abc import Sequence
from typing import Any

import keras

from custom_fit import _keras_compat
from custom_fit._types import Variable

_Layers = Any  # a layer, a layer name, or a list of them


@keras.saving.register_keras_serializable(package="custom_fit")
class MultiOptimizer(keras.optimizers.Optimizer):
    """Updates each group of layers with its own optimizer.

    Per-layer learning rates, and more: every group has its own optimizer,
    with its own slots, learning rate and schedule (Adam at 1e-5 for a
    pretrained backbone, Adam at 1e-3 for a new head). Scaling gradients is
    no substitute: under Adam a constant factor on the gradient cancels
    out.

    Pass it to `compile(optimizer=...)`. With custom_fit's mixins, the
    pipeline's transforms (global clipping, inspection, the non-finite
    guard, gradient accumulation) act on the whole model's true gradients
    first; then each group's optimizer applies its share. On a skipped step
    no group applies. `optimizer.iterations` counts updates of the whole
    model; each group's optimizer keeps its own count (for its schedule).
    A group's optimizer may average its weights (`use_ema=True`): `fit`
    ends with them replaced by their average, and from Keras 3.15
    `keras.callbacks.SwapEMAWeights` swaps them in for evaluation.

    Every trainable variable must be in exactly one group: one in no group,
    or in two, is refused when the optimizer is built (at the first `fit`),
    naming it.

    Args:
        optimizers_and_layers: List of pairs `(optimizer, layers)`.
            `optimizer` is a `keras.optimizers.Optimizer` (or its name, such
            as `"adam"`). `layers` is a layer, a layer name, or a list of
            them; a name selects the variables whose path holds it as a run
            of layer names (`"head"`, or `"encoder/dense_1"` inside a nested
            model).
        name: String. The optimizer's name.

    Example:

    ```python
    model.compile(
        optimizer=custom_fit.MultiOptimizer([
            (keras.optimizers.Adam(1e-5), backbone),   # a layer
            (keras.optimizers.Adam(1e-3), ["head"]),   # by name
        ]),
        loss="sparse_categorical_crossentropy",
    )
    ```
    """

    def __init__(
        self,
        optimizers_and_layers: Sequence[tuple[Any, _Layers]],
        name: str | None = None,
    ) -> None:
        super().__init__(learning_rate=0.0, name=name)
        pairs = _checked_pairs(optimizers_and_layers)
        self._groups = [
            (keras.optimizers.get(optimizer), _as_list(layers))
            for optimizer, layers in pairs
        ]
        self._group_of: dict[int, int] = {}

    @property
    def optimizers(self) -> list[keras.optimizers.Optimizer]:
        """The optimizer of each group, in order."""
        return [optimizer for optimizer, _ in self._groups]

    @property
    def variables(self) -> list[Variable]:
        """Its own variables (the update count), then every group's."""
        found = list(super().variables)
        for optimizer in self.optimizers:
            found.extend(optimizer.variables)
        return found

    @property
    def learning_rate(self) -> Any:
        """Refused: every group has its own learning rate."""
        raise AttributeError(
            "A MultiOptimizer has one learning rate per group. Received: a "
            "read or write of `learning_rate`. Use "
            "`optimizer.optimizers[i].learning_rate` for group i. (Keras' "
            "TensorBoard callback reads one learning rate before Keras "
            "3.15, which logs one per group: use Keras >= 3.15 with "
            "TensorBoard.)"
        )

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        if not hasattr(self, "_groups"):  # the base constructor's own set
            keras.optimizers.Optimizer.learning_rate.fset(self, value)
            return
        raise AttributeError(
            "A MultiOptimizer has one learning rate per group. Received: "
            f"learning_rate={value!r}. Set "
            "`optimizer.optimizers[i].learning_rate` for group i."
        )

    def build(self, variables: Sequence[Variable]) -> None:
        """Assigns every variable to its group and builds each optimizer.

        Args:
            variables: The trainable variables to update.

        Raises:
            ValueError: Naming a variable in no group or in two, or a layer
                name that matches no variable.
        """
        variables = list(variables)
        members = [
            _members(layers, variables, index)
            for index, (_, layers) in enumerate(self._groups)
        ]
        self._group_of = {}
        for variable in variables:
            groups = [i for i, ids in enumerate(members) if id(variable) in ids]
            if len(groups) != 1:
                where = "in no group" if not groups else f"in groups {groups}"
                raise ValueError(
                    "Every trainable variable must be in exactly one group "
                    f"of the MultiOptimizer. Received: {variable.path!r} "
                    f"{where}. Put each layer with trainable weights in one "
                    "group."
                )
            self._group_of[id(variable)] = groups[0]
        for index, (optimizer, _) in enumerate(self._groups):
            optimizer.build(
                [v for v in variables if self._group_of[id(v)] == index]
            )
        super().build(variables)

    def apply(
        self, grads: Sequence[Any], trainable_variables: Any = None
    ) -> None:
        """Applies each group's gradients with its optimizer.

        Args:
            grads: List of gradients aligned with `trainable_variables`.
            trainable_variables: The variables (by default those it was
                built with).
        """
        if trainable_variables is None:
            trainable_variables = _keras_compat.optimizer_trainable_variables(
                self
            )
        trainable_variables = list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        for index, (optimizer, _) in enumerate(self._groups):
            pairs = [
                (g, v)
                for g, v in zip(grads, trainable_variables)
                if g is not None and self._group_of.get(id(v)) == index
            ]
            if pairs:
                optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        self.iterations.assign_add(1)

    def finalize_variable_values(self, var_list: Sequence[Variable]) -> None:
        """Lets each group's optimizer finalize its variables.

        Keras calls it at the end of `fit`: a group whose optimizer keeps
        an average of the weights (`use_ema=True`) then gets its weights
        replaced by the average, as a single optimizer's would.

        Args:
            var_list: The model's trainable variables.
        """
        for index, (optimizer, _) in enumerate(self._groups):
            members = [
                v for v in var_list if self._group_of.get(id(v)) == index
            ]
            if members:
                optimizer.finalize_variable_values(members)

    def get_config(self) -> dict[str, Any]:
        """Returns each group's optimizer (serialized) and layer names."""
        return {
            "name": self.name,
            "optimizers_and_layers": [
                {
                    "optimizer": keras.optimizers.serialize(optimizer),
                    "layers": [_layer_name(layer) for layer in layers],
                }
                for optimizer, layers in self._groups
            ],
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: Any = None
    ) -> "MultiOptimizer":
        """Rebuilds the optimizer from `get_config()`."""
        pairs = [
            (
                keras.optimizers.deserialize(
                    group["optimizer"], custom_objects=custom_objects
                ),
                group["layers"],
            )
            for group in config["optimizers_and_layers"]
        ]
        return cls(pairs, name=config.get("name"))


def _checked_pairs(pairs: Any) -> list[tuple[Any, Any]]:
    """Returns `pairs` as a list after checking its form."""
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError(
            "`optimizers_and_layers` must be a non-empty list of "
            f"(optimizer, layers) pairs. Received: {pairs!r}. Pass for "
            "example [(keras.optimizers.Adam(1e-5), backbone), "
            "(keras.optimizers.Adam(1e-3), head)]."
        )
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ValueError(
                "Each entry of `optimizers_and_layers` must be a pair "
                f"(optimizer, layers). Received: {pair!r}. Pass a tuple of "
                "an optimizer and a layer, a layer name, or a list of them."
            )
        if isinstance(pair[0], keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "A group's optimizer cannot be a LossScaleOptimizer: loss "
                "scaling is the whole model's. Received: "
                f"{pair[0]!r}. Pass the inner optimizer; compile wraps the "
                "MultiOptimizer under mixed precision."
            )
    return list(pairs)


def _as_list(layers: Any) -> list[Any]:
    """Returns a group's layers as a non-empty list."""
    listed = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    if not listed:
        raise ValueError(
            "Each group of a MultiOptimizer needs at least one layer. "
            "Received: layers=[]. Pass a layer, a layer name, or a list."
        )
    for layer in listed:
        if not isinstance(layer, (str, keras.layers.Layer)):
            raise ValueError(
                "A group's layers must be Keras layers or layer names. "
                f"Received: {layer!r} of type {type(layer).__name__}. Pass "
                "the layer object or its name."
            )
    return listed


def _layer_name(layer: Any) -> str:
    """Returns the name under which a group's layer is serialized."""
    return layer if isinstance(layer, str) else layer.name


def _members(
    layers: list[Any], variables: list[Variable], group: int
) -> set[int]:
    """Returns the ids of `variables` that the group's `layers` select."""
    selected: set[int] = set()
    for layer in layers:
        if isinstance(layer, str):
            found = {id(v) for v in variables if _path_holds(v.path, layer)}
            if not found:
                paths = sorted({v.path.rsplit("/", 1)[0] for v in variables})
                raise ValueError(
                    f"Group {group} of the MultiOptimizer names a layer that "
                    f"has no trainable variable: {layer!r}. Received: "
                    f"layers={layers!r}. Use names from the variables' "
                    f"paths: {paths}."
                )
        else:
            found = {id(v) for v in layer.trainable_variables}
        selected |= found
    return selected


def _path_holds(path: str, name: str) -> bool:
    """Returns whether `name` is a run of the layer names of `path`."""
    layers = path.split("/")[:-1]
    wanted = name.split("/")
    return any(
        layers[i : i + len(wanted)] == wanted
        for i in range(len(layers) - len(wanted) + 1)
    )
