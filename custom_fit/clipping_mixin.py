"""`GradientClippingMixin`: clipping of the true gradients."""

from collections.abc import Sequence
from typing import Any

from custom_fit import _figures
from custom_fit import _layer_groups
from custom_fit import _options
from custom_fit import _validation
from custom_fit import clipping
from custom_fit._types import Gradients
from custom_fit._types import Variable
from custom_fit.train_step_mixin import TrainStepMixin

_CLIPPING_OPTIONS = (
    "adaptive_clipping",
    "clipvalue",
    "clipnorm",
    "layer_clipnorm",
    "global_clipnorm",
)


def _clipping_bound() -> _options.Option:
    """Returns the declaration of one clipping bound.

    Off (`None`) by default, else finite and greater than 0; schedulable.
    """
    return _options.Option(
        None,
        _validation.positive_float_or_none,
        bound=True,
        kind="clipping",
        schedulable=True,
    )


class GradientClippingMixin(TrainStepMixin):
    """Clips the true gradients: after unscaling, after the replica sum.

    Keras' optimizer-level `clipnorm`, `clipvalue` and `global_clipnorm`
    act on each replica's share under `tf.distribute`, before the replicas
    are summed. This mixin clips in `transform_gradients`, where gradients
    are already unscaled and summed, so the result equals single-device
    clipping of the global batch. It also adds per-layer and adaptive
    clipping, and can leave layers out.

    When several options are set they apply finest first: adaptive (per
    unit), `clipvalue` (per entry), `clipnorm` (per variable),
    `layer_clipnorm` (per layer), `global_clipnorm` (all gradients). Later
    steps only scale down, so every bound set holds at the end.

    Args:
        clipvalue: Float or `None`. Every gradient entry is clipped to
            `[-clipvalue, clipvalue]`, as Keras' optimizer argument.
        clipnorm: Float or `None`. Each variable's gradient is rescaled to
            an L2 norm of at most `clipnorm`, as Keras' optimizer argument.
        global_clipnorm: Float or `None`. All clipped gradients together
            are rescaled to a global L2 norm of at most `global_clipnorm`,
            as Keras' optimizer argument.
        layer_clipnorm: Float or `None`. For each entry of `model.layers`
            that owns trainable variables, its gradients are jointly
            rescaled to an L2 norm of at most `layer_clipnorm`. Variables
            of the model itself (not of a layer) form one more group.
        adaptive_clipping: Float or `None`. Unit-wise adaptive gradient
            clipping (AGC) with this ratio of gradient norm to weight norm;
            see `custom_fit.clipping.adaptive_clip`. Brock et al. use 0.01
            to 0.16, and leave the final classifier out.
        adaptive_clipping_eps: Float. Floor on the weight norm in adaptive
            clipping. Defaults to `1e-3`.
        clip_layers: List of layer names, or `None`. Only the gradients of
            these entries of `model.layers` are clipped (and only they
            count towards the global norm). Defaults to all layers. A
            frozen layer may be named (it may train again later), but not
            only frozen ones: that would clip nothing, and `fit` refuses it.
        no_clip_layers: List of layer names, or `None`. The gradients of
            these layers are never clipped. Exclusive with `clip_layers`.
            Leaving out every layer that trains is refused.

    Each option defaults to `None` (off); all values must be finite and
    greater than 0. A `ValueError` names the argument otherwise. If the
    optimizer also clips, a warning is emitted once.

    Example:
    ```python
    class Net(custom_fit.GradientClippingMixin, keras.Model):
        pass

    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="classifier")(hidden)
    model = Net(inputs, outputs, adaptive_clipping=0.01,
                no_clip_layers=["classifier"])
    model.compile(optimizer="sgd", loss="mse")
    ```

    References:
        - [Pascanu et al., 2013](https://arxiv.org/abs/1211.5063), "On the
          difficulty of training recurrent neural networks".
        - [Brock et al., 2021](https://arxiv.org/abs/2102.06171),
          "High-Performance Large-Scale Image Recognition Without
          Normalization".
    """

    reports = _CLIPPING_OPTIONS  # the value in force of a schedule

    clipvalue = _clipping_bound()
    clipnorm = _clipping_bound()
    global_clipnorm = _clipping_bound()
    layer_clipnorm = _clipping_bound()
    adaptive_clipping = _clipping_bound()
    adaptive_clipping_eps = _options.Option(
        1e-3,
        _validation.positive_float,
        requires=("adaptive_clipping",),
        bound=True,
    )
    clip_layers = _options.Option(
        None, _validation.names_or_none, requires=_CLIPPING_OPTIONS
    )
    no_clip_layers = _options.Option(
        None, _validation.names_or_none, requires=_CLIPPING_OPTIONS
    )

    def _configure_options(self, options: dict[str, Any]) -> None:
        """Adds checks of the layer selection.

        `clip_layers` and `no_clip_layers` are exclusive, and name layers of
        the model: checked here when the layers are known at construction
        (functional and Sequential models), else at the first step.
        """
        super()._configure_options(options)
        if self.clip_layers is not None and self.no_clip_layers is not None:
            raise ValueError(
                "Only one of `clip_layers` and `no_clip_layers` can be set. "
                f"Received: clip_layers={list(self.clip_layers)}, "
                f"no_clip_layers={list(self.no_clip_layers)}. Pass only one "
                "of them."
            )
        if self.layers:
            self._check_selected_layers()

    def _check_before_fit(self) -> None:
        """Checks `clip_layers` and `no_clip_layers` against the layers now.

        A layer frozen since the model was made may leave `clip_layers`
        nothing to clip: refused when `fit` starts, before any update (of
        this network or of another in the same step).
        """
        super()._check_before_fit()
        selection = (self.clip_layers, self.no_clip_layers)
        if self.built and selection != (None, None):
            owners = self.layer_names_of(self.trainable_variables)
            self._check_selected_layers(own_variables=self.name in owners)

    def transform_gradients(
        self, gradients: Gradients, variables: Sequence[Variable]
    ) -> Gradients:
        """Clips the selected gradients, then calls `super()`.

        Runs after `compute_gradients`: the gradients are true (not
        loss-scaled, summed across replicas).

        Args:
            gradients: List aligned with `variables`.
            variables: The variables the gradients belong to.

        Returns:
            The list of gradients, clipped where selected.
        """
        if _options.any_set(self, "clipping"):
            gradients = self._clip(gradients, variables)
        return super().transform_gradients(gradients, variables)

    def _clip(
        self, gradients: Gradients, variables: Sequence[Variable]
    ) -> Gradients:
        """Runs `clipping.clip` on the gradients of the selected layers."""
        owners = self._owning_layer_names(variables)
        selected = [self._is_clipped(owner) for owner in owners]
        clipped = clipping.clip(
            [g if keep else None for g, keep in zip(gradients, selected)],
            variables,
            owners,
            adaptive_clipping=self.option_in_step("adaptive_clipping"),
            adaptive_clipping_eps=self.adaptive_clipping_eps,
            clipvalue=self.option_in_step("clipvalue"),
            clipnorm=self.option_in_step("clipnorm"),
            group_clipnorm=self.option_in_step("layer_clipnorm"),
        )
        global_clipnorm = self.option_in_step("global_clipnorm")
        if global_clipnorm is not None:
            clipped = self._clip_globally(clipped, global_clipnorm)
        return [
            new if keep else old
            for old, new, keep in zip(gradients, clipped, selected)
        ]

    def _clip_globally(
        self, gradients: Gradients, global_clipnorm: Any
    ) -> Gradients:
        """Global clipping, with the update's shared figures.

        The norm is that of the update's figures when the gradients are the
        true ones (nothing clipped before, every layer selected), so no
        second pass reads them; the clipped list's figures are known from
        the factor and registered for inspection and the guard.
        """
        figures = _figures.of(self, gradients)
        clipped, factor = clipping.globally_clipped(
            gradients, global_clipnorm, figures.norm
        )
        _figures.register(self, figures.scaled(clipped, factor))
        return clipped

    def _is_clipped(self, owner: str) -> bool:
        """Returns whether gradients of the group named `owner` are clipped.

        A name selects its group and, with `layer_depth` above 1, the groups
        nested in it (`"encoder"` selects `"encoder/dense_1"`).
        """
        if self.clip_layers is not None:
            return any(_within(owner, name) for name in self.clip_layers)
        if self.no_clip_layers is not None:
            return not any(_within(owner, name) for name in self.no_clip_layers)
        return True

    def _owning_layer_names(self, variables: Sequence[Variable]) -> list[str]:
        """Returns each variable's layer name; checks the selected names.

        The check runs again at trace time, when the layers of every kind of
        model are known.
        """
        owners = self.layer_names_of(variables)
        self._check_selected_layers(own_variables=self.name in owners)
        return owners

    def _check_selected_layers(self, own_variables: bool = False) -> None:
        """Raises if `clip_layers` or `no_clip_layers` names a missing layer.

        A frozen layer is not missing: its name is accepted, as the layer
        may train again later. The model's own name selects the variables
        the model itself owns (not a layer's); it is accepted only when
        there are such variables. A selection that leaves no trainable
        variable to clip (`clip_layers` naming frozen layers only,
        `no_clip_layers` every layer that trains) would clip nothing, and
        is refused too.
        """
        known = _layer_groups.group_names(self, self.layer_depth)
        accepted = known + [self.name] if own_variables else known
        for argument in ("clip_layers", "no_clip_layers"):
            _validation.known_names(
                argument, getattr(self, argument), accepted, "layers"
            )
        if not self.built or (self.clip_layers, self.no_clip_layers) == (
            None,
            None,
        ):
            return
        groups = self.layer_names_of(self.trainable_variables)
        if not groups or any(self._is_clipped(group) for group in groups):
            return
        training = list(dict.fromkeys(groups))
        if self.clip_layers is not None:
            raise ValueError(
                "`clip_layers` selects no trainable variable: the layers it "
                "names have none (frozen, or without weights), so nothing "
                f"would be clipped. Received: clip_layers="
                f"{list(self.clip_layers)}; the layers that train: "
                f"{training}. Name one of those, or pass "
                "`clip_layers=None` while the named layers are frozen."
            )
        raise ValueError(
            "`no_clip_layers` leaves out every layer that trains, so nothing "
            "would be clipped. Received: no_clip_layers="
            f"{list(self.no_clip_layers or ())}; the layers that train: "
            f"{training}. Leave one of those in, or turn clipping off."
        )


def _within(group: str, name: str) -> bool:
    """Returns whether the group `group` is `name` or nested in it."""
    return group == name or group.startswith(name + "/")
