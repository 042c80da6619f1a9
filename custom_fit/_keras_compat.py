"""The only module that touches private Keras names.

`TrainStepMixin` must behave exactly like `TensorFlowTrainer.train_step`
(keras/src/backend/tensorflow/trainer.py), which uses three private
attributes; it works around one Keras bug under MultiWorkerMirroredStrategy
through a private method (`PrivateOverrides`); and it recognises Keras'
`clone_model` from its private helpers, so that a clone keeps the mixin
options. Each use is isolated here and pinned by
`tests/keras_compat_test.py`, so a Keras upgrade that renames one fails
there first.
"""

import sys
from types import FrameType
from typing import TYPE_CHECKING
from typing import Any

import keras
import numpy as np
from keras import ops

from custom_fit import _model_state
from custom_fit import backend

# Keras' helpers of `keras.models.clone_model` (keras/src/models/cloning.py).
_CLONE_FUNCTIONAL = "_clone_functional_model"
_CLONE_SEQUENTIAL = "_clone_sequential_model"


def call_model(model: keras.Model, x: Any, training: bool) -> Any:
    """Calls `model` on `x`, passing `training` only if `call` accepts it.

    Keras records whether `call` has a `training` argument in
    `_call_has_training_arg`.
    """
    if getattr(model, "_call_has_training_arg", True):
        return model(x, training=training)
    return model(x)


def compute_loss(
    model: keras.Model,
    x: Any,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
    training: bool,
) -> Any:
    """Calls `model.compute_loss`, also for overrides without `training`.

    `Trainer._compute_loss` is Keras' own compatibility wrapper for
    `compute_loss` overrides written before Keras 3.3 added `training`.
    """
    wrapper = getattr(model, "_compute_loss", None)
    if wrapper is not None:
        return wrapper(
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )
    return model.compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def batch_size(x: Any, dtype: str) -> Any:
    """Returns the size of the batch `x` (its first input's first axis).

    Args:
        x: The inputs of a batch (a tensor or a nested structure).
        dtype: The dtype of the result.

    Returns:
        A scalar tensor of `dtype`.
    """
    first_input = next(i for i in keras.tree.flatten(x) if i is not None)
    return ops.cast(ops.shape(first_input)[0], dtype)


def track_loss(model: keras.Model, loss: Any, x: Any) -> None:
    """Updates the `loss` metric exactly as Keras' `train_step` does.

    `Trainer._loss_tracker` is the `Mean` metric behind `logs["loss"]`. Keras
    weights each batch by its size and undoes the `1 / num_replicas` scaling
    that `compute_loss` applies under `tf.distribute`.

    Args:
        model: The model.
        loss: Scalar tensor, the loss of the batch (not loss-scaled).
        x: The inputs of the batch, for its size.
    """
    weight = batch_size(x, loss.dtype)
    replicas = backend.current().replica_count()
    if replicas > 1:  # as Keras' unscale_loss_for_distribution: no op on one
        loss = loss * ops.cast(replicas, loss.dtype)
    model._loss_tracker.update_state(loss, sample_weight=weight)


if TYPE_CHECKING:
    # The mixins are used before a Keras model class; type checkers see
    # its attributes through this base, at run time it is `object`.
    from keras import Model as _ModelBase
else:
    _ModelBase = object


class PrivateOverrides(_ModelBase):
    """Overrides of private Keras methods, mixed into `TrainStepMixin`."""

    def _maybe_symbolic_build(
        self, iterator: Any = None, data_batch: Any = None
    ) -> None:
        """Keras' pre-`fit` build, fixed for MultiWorkerMirroredStrategy.

        The backend may hand Keras a batch of its own (TensorFlow's
        MultiWorkerMirroredStrategy: see its adapter's `build_batch`).
        """
        if iterator is not None:
            batch = backend.current().build_batch(self, iterator)
            if batch is not None:
                data_batch, iterator = batch, None
        return super()._maybe_symbolic_build(  # type: ignore[misc]
            iterator=iterator, data_batch=data_batch
        )

    def _symbolic_build(
        self, iterator: Any = None, data_batch: Any = None
    ) -> None:
        """Keras' pre-`fit` build, with `report_metric` muted.

        The build traces `compute_loss` once, outside any step (in
        cross-replica context under a strategy); that trace is not a step.
        A model with no `call` of its own (a GAN whose `train_step` updates
        its networks) cannot be built from a batch: it counts as built once
        every layer in it is, and otherwise is refused with the fix.
        """
        _build_container(self)
        with _model_state.state_of(self).metrics.muting():
            return super()._symbolic_build(  # type: ignore[misc]
                iterator=iterator, data_batch=data_batch
            )


def _build_container(model: Any) -> None:
    """Marks built a model without `call` whose layers are all built.

    Raises:
        ValueError: Naming its unbuilt layers and how to build them.
    """
    own_call = type(model).call not in (
        keras.Model.call,
        keras.layers.Layer.call,
    )
    if model.built or own_call:
        return
    unbuilt = [layer.name for layer in all_layers(model) if not layer.built]
    if not unbuilt:
        model.built = True
        return
    raise ValueError(
        f"{type(model).__name__} has no `call` of its own (its `train_step` "
        "runs its networks), so Keras cannot build it from a batch, and "
        f"some of its layers are not built yet. Received: the unbuilt "
        f"layers {unbuilt}. Build each network before `fit`: create it "
        "from `keras.Input` (a functional model), or call it once on a "
        "batch."
    )


def per_output_losses(
    model: keras.Model, y: Any, y_pred: Any, sample_weight: Any
) -> dict[str, Any]:
    """Returns the compiled loss of each output, weighted, by output name.

    Keras' `CompileLoss` (`Trainer._compile_loss`) sums these; its built
    list `_flat_losses` holds `(path, loss, weight, name)` per output, and
    its `_y_pred_build_structure` / `_y_true_build_structure` the
    structures it was built with. The values are as Keras adds them to the
    loss (scaled for `tf.distribute`), without updating its per-output loss
    metrics. Call it after the model's `compute_loss` in the same step (the
    compiled loss is then built).

    Args:
        model: A compiled model.
        y: The targets of the batch.
        y_pred: The predictions.
        sample_weight: The sample weights, or `None`.

    Returns:
        A dict of output name to scalar loss (empty without a compiled
        loss).
    """
    return {
        name: value
        for name, _, value, _ in _output_losses(model, y, y_pred, sample_weight)
    }


def summed_example_losses(
    model: keras.Model, y: Any, y_pred: Any, sample_weight: Any
) -> tuple[Any, str]:
    """Returns the sum over the batch of each example's compiled loss.

    Each example's loss is what `per_output_losses` gives for a batch of
    that example alone (times the replica count, as
    `DifferentialPrivacyMixin` counts it). Keras' reductions are linear in
    the examples' weighted losses: the sum is the batch's loss times the
    batch size for `"sum_over_batch_size"` and `"mean"` (a sum over the
    loss's values divided by their count) and times 1 for `"sum"`, read
    from each compiled `Loss`'s `reduction`. Not for
    `"mean_with_sample_weight"` with sample weights, a reduction of
    `None`, a loss whose values (`Loss.call`) are one number per batch
    (`keras.losses.Dice` without an `axis`), or a custom loss function
    or class, which could be either, or mix the examples.

    Args:
        model: A compiled model, its `compute_loss` run in this step.
        y: The targets of the batch.
        y_pred: The predictions.
        sample_weight: The sample weights, or `None`.

    Returns:
        A tuple `(sum, problem)`: a scalar, or `None` with a sentence
        saying which loss is not linear in the examples.
    """
    total = None
    for name, loss, value, pair in _output_losses(
        model, y, y_pred, sample_weight
    ):
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction not in ("sum", "sum_over_batch_size", "mean") and not (
            reduction == "mean_with_sample_weight" and sample_weight is None
        ):
            return None, (
                f"the loss of the output {name!r} has the reduction "
                f"{reduction!r}, which is not a sum of per-example losses"
            )
        if not _per_example_values(loss):
            return None, (
                f"the loss of the output {name!r} is a custom function or "
                "class, whose values may be one number per batch"
            )
        if len(_unreduced(loss, pair).shape) == 0:
            return None, (
                f"the loss of the output {name!r} ({type(loss).__name__}) "
                "computes one number for the whole batch, not one per "
                "example"
            )
        if reduction != "sum":
            value = value * batch_size(y_pred, "float32")
        total = value if total is None else total + value
    if total is None:
        return None, "the model has no compiled loss"
    return total, ""


def build_compiled_loss(model: keras.Model, x: Any, y: Any) -> None:
    """Builds the model's compiled loss (`_compile_loss`) for a batch.

    As Keras builds it before the first step, from the output's symbolic
    shapes (`compute_output_spec`): nothing runs.

    Args:
        model: A compiled, built model.
        x: The inputs of a batch.
        y: Its targets.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is not None and not compile_loss.built:
        specs = keras.tree.map_structure(
            lambda t: keras.KerasTensor(np.shape(t), np.asarray(t).dtype), x
        )
        compile_loss.build(y, model.compute_output_spec(specs))


def example_loss_values(
    model: keras.Model, y: Any, y_pred: Any
) -> list[tuple[str, Any]]:
    """Returns each compiled loss's values before its reduction.

    For a check outside the step, the compiled loss (`_compile_loss`)
    built (`build_compiled_loss`; else it is built here, as Keras builds it
    at the first step). One value per example has the batch as its first
    axis.

    Args:
        model: A compiled model.
        y: The targets of a batch.
        y_pred: The model's predictions for it.

    Returns:
        A list of `(output name, values)`, empty without a compiled loss.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None:
        return []
    if not compile_loss.built:
        compile_loss.build(y, y_pred)
    return [
        (name, _unreduced(loss, pair))
        for name, loss, _, pair in _output_losses(model, y, y_pred, None)
    ]


def _unreduced(loss: Any, pair: tuple[Any, Any]) -> Any:
    """Returns a compiled loss's values before its reduction.

    As its `__call__` computes them: `Loss.call` on tensors of its dtype.
    """
    y_true, y_pred = (
        keras.tree.map_structure(
            lambda t: ops.convert_to_tensor(t, dtype=loss.dtype), part
        )
        for part in pair
    )
    return loss.call(y_true, y_pred)


def _per_example_values(loss: Any) -> bool:
    """Whether a compiled loss is one of Keras' own (one value per entry).

    `LossFunctionWrapper` (`Loss.call` of a function) wraps Keras' loss
    functions and users' alike: its `fn` tells them apart.
    """
    function = getattr(loss, "fn", None) or type(loss)
    module = getattr(function, "__module__", "") or ""
    return module.startswith("keras.")


def _output_losses(
    model: keras.Model, y: Any, y_pred: Any, sample_weight: Any
) -> list[tuple[str, Any, Any, tuple[Any, Any]]]:
    """Returns `(name, loss, weighted value, (y_true, y_pred))` per output."""
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None:
        return []
    flat = keras.tree.flatten
    if keras.tree.is_nested(y_pred) or keras.tree.is_nested(y):
        y_pred = keras.tree.pack_sequence_as(
            compile_loss._y_pred_build_structure, flat(y_pred)
        )
        y = keras.tree.pack_sequence_as(
            compile_loss._y_true_build_structure, flat(y)
        )

    def at(path: tuple, value: Any) -> Any:
        for key in path:
            value = value[key]
        return value

    losses = []
    for path, loss, weight, name in compile_loss._flat_losses:
        weights = sample_weight
        if sample_weight is not None and keras.tree.is_nested(sample_weight):
            weights = at(path, sample_weight)
        pair = (at(path, y), at(path, y_pred))
        value = ops.cast(loss(*pair, weights), "float32")
        if weight is not None:
            value = value * weight
        losses.append((name, loss, value, pair))
    return losses


def all_layers(layer: Any) -> list[Any]:
    """Returns every layer inside `layer`, at any depth, without it.

    `Layer._flatten_layers` walks the layers Keras tracks as attributes
    (those of a custom layer too, which `model.layers` does not list).
    """
    return list(layer._flatten_layers(include_self=False, recursive=True))


def optimizer_trainable_variables(optimizer: Any) -> list[Any]:
    """Returns the variables an optimizer was built for, in its order.

    `BaseOptimizer._trainable_variables` (a `LossScaleOptimizer` applies
    through its inner optimizer's) is what `stateless_apply` expects the
    values of, on JAX.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return list(inner._trainable_variables)


def model_being_cloned(depth: int = 8) -> Any:
    """Returns the model that `keras.models.clone_model` is cloning, if any.

    For a functional model, Keras' `_clone_functional_model` builds the
    clone with `model.__class__(inputs, outputs, name=...)`, without the
    mixin keywords. Called from the clone's constructor, this finds the
    original model in that helper's frame, so that the clone can take its
    options.

    Args:
        depth: How many calling frames to look through.

    Returns:
        The model being cloned, or `None` outside `clone_model`.
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == _CLONE_FUNCTIONAL:
            return frame.f_locals.get("model")
        frame = frame.f_back
    return None


def refuse_sequential_clone(model: Any) -> None:
    """Raises when `keras.models.clone_model` clones a Sequential subclass.

    Keras' `_clone_sequential_model` returns a plain `keras.Sequential`
    whatever the class of the model, so every mixin option and hook would
    be lost without a word. It reads `model.layers` first; the mixin calls
    this from there.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(2):  # the helper, or a comprehension inside it
        if frame is None:
            return
        if frame.f_code.co_name == _CLONE_SEQUENTIAL:
            raise ValueError(
                "keras.models.clone_model returns a plain keras.Sequential "
                "for a subclass of Sequential, which would drop the "
                f"custom_fit options and hooks of {type(model).__name__}. "
                f"Received: a {type(model).__name__} model. Clone it with "
                "`type(model).from_config(model.get_config())` instead."
            )
        frame = frame.f_back
