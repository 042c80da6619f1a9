"""`RegularizationMixin`: named loss components, penalties, as metrics."""

from typing import Any

import keras
import tensorflow as tf

from custom_fit import _keras_compat
from custom_fit import _options
from custom_fit import _validation
from custom_fit import pipeline
from custom_fit import regularization
from custom_fit._types import Scalar
from custom_fit.train_step import TrainStepMixin

_BUILT_IN_TERMS = ("l1_penalty", "l2_penalty", "input_gradient_penalty")
_COMPONENT_NAMES = ("data_loss", "regularization_loss")
# Metrics the library's own mixins report: a term of that name would be
# merged with them.
_LIBRARY_METRICS = (
    "grad_norm",
    "grad_norm_clipped",
    "skipped_steps",
    "clip_rate",
)


class RegularizationMixin(TrainStepMixin):
    """Adds named penalties to the loss and logs every loss component.

    Each step logs, besides Keras' total `loss`:

    - `data_loss`: the compiled loss alone;
    - `regularization_loss`: Keras' own regularization, the sum of
      `model.losses` (kernel, bias and activity regularizers, `add_loss`),
      when the model has any;
    - one entry per penalty: the keyword penalties below and each term
      returned by the `regularization_losses` hook, under its name.

    Validation logs get the same entries as `val_<name>`. Each is a running
    mean over the epoch, weighted by batch size like Keras' loss, and reset
    at every epoch and `evaluate()` (see `TrainStepMixin.report_metric`).

    Penalties are added to the loss of each replica divided by the replica
    count, as Keras does for its own losses, so under `tf.distribute` they
    count once, not once per replica.

    Args:
        l1: Float or `None`. Adds `l1 * sum(|w|)` over the penalized
            variables.
        l2: Float or `None`. Adds `l2 * sum(w**2)` over the penalized
            variables (the `keras.regularizers.L2` formula).
        penalized_variable_names: List of variable names (the last path
            component) that `l1` and `l2` act on. Defaults to weight
            matrices: `("kernel", "embeddings", "depthwise_kernel")`, not
            biases nor normalization `gamma`/`beta`. Pass for example
            `["kernel", "bias"]` to include biases.
        input_gradient_penalty: Float or `None`. Adds this weight times a
            penalty on the gradient of the loss with respect to the
            inputs, computed with a nested tape (one more call of
            `forward_pass` and one more backward pass per step). Only
            floating-point inputs are differentiated (integer inputs such
            as token ids are left out); at least one is needed. An input
            the loss does not depend on has a zero gradient.
        input_gradient_penalty_form: `"squared_norm"` (double
            backpropagation, Drucker & LeCun 1992: `p_i = ||g_i||^2`) or
            `"wgan_gp"` (`p_i = (||g_i|| - 1)^2`). `g_i` is the gradient of
            sample `i`'s unweighted loss with respect to its inputs. The
            penalty is `mean_i p_i`, or with sample weights
            `sum_i(w_i * p_i) / batch_size`, as Keras reduces a weighted
            loss (`"sum_over_batch_size"`).

    Example:

    ```python
    class Net(custom_fit.RegularizationMixin, keras.Model):
        def regularization_losses(self, x, y, y_pred):
            return {"confidence": 0.01 * ops.mean(ops.square(y_pred))}

    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3)(inputs)
    model = Net(inputs, outputs, l2=1e-4)
    model.compile(optimizer="adam", loss="mse")
    # History: loss, data_loss, l2_penalty, confidence (and val_...).
    ```
    """

    l1 = _options.Option(None, _validation.positive_float_or_none)
    l2 = _options.Option(None, _validation.positive_float_or_none)
    penalized_variable_names = _options.Option(
        regularization.DEFAULT_PENALIZED_NAMES, _validation.names_or_none
    )
    input_gradient_penalty = _options.Option(
        None, _validation.positive_float_or_none
    )
    input_gradient_penalty_form = _options.Option(
        "squared_norm", _validation.one_of(regularization.INPUT_GRADIENT_FORMS)
    )

    def regularization_losses(
        self, x: Any, y: Any, y_pred: Any
    ) -> dict[str, Scalar]:
        """Returns named penalties to add to the loss. Override it.

        Runs inside `compute_loss`, in `train_step` and `test_step`, after
        the forward pass, under the gradient tape.

        Args:
            x: Inputs of the batch.
            y: Targets of the batch.
            y_pred: Predictions of the forward pass.

        Returns:
            A dict of name to scalar tensor. Each value is added to the
            loss and logged under its name. The default returns `{}`.
        """
        del x, y, y_pred
        return {}

    def compute_loss(
        self,
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: Any = None,
        training: bool = True,
    ) -> tf.Tensor:
        """Returns Keras' loss plus every penalty, logging each component.

        Args:
            x: Inputs of the batch.
            y: Targets of the batch.
            y_pred: Predictions of the forward pass.
            sample_weight: Sample weights of the batch, or `None`.
            training: Bool. Whether this is a training step.

        Returns:
            The total loss of this replica (penalties divided by the replica
            count, as Keras scales its own losses).
        """
        total = super().compute_loss(
            x, y, y_pred, sample_weight, training=training
        )
        replicas = pipeline.replica_count()
        batch_size = _keras_compat.batch_size(x, total.dtype)
        unscaled_total = total * replicas if replicas > 1 else total
        model_losses = [
            tf.reduce_sum(tf.cast(loss, total.dtype)) for loss in self.losses
        ]
        if model_losses:
            regularization_loss = tf.add_n(model_losses)
            self.report_metric(
                "regularization_loss", regularization_loss, batch_size
            )
            unscaled_total -= regularization_loss
        self.report_metric("data_loss", unscaled_total, batch_size)
        terms = self._penalties(x, y, y_pred, sample_weight, training)
        for name, value in terms.items():
            self.report_metric(name, value, batch_size)
            value = tf.cast(value, total.dtype)
            total += value / replicas if replicas > 1 else value
        return total

    def _penalties(
        self,
        x: Any,
        y: Any,
        y_pred: Any,
        sample_weight: Any,
        training: bool,
    ) -> dict[str, tf.Tensor]:
        """Returns the keyword penalties and the hook's terms, checked."""
        terms: dict[str, tf.Tensor] = {}
        penalized = regularization.select_variables(
            self.trainable_variables, self.penalized_variable_names or ()
        )
        if self.l1 is not None:
            terms["l1_penalty"] = regularization.l1_penalty(penalized, self.l1)
        if self.l2 is not None:
            terms["l2_penalty"] = regularization.l2_penalty(penalized, self.l2)
        if self.input_gradient_penalty is not None:
            terms["input_gradient_penalty"] = (
                self.input_gradient_penalty
                * self._input_gradient_term(x, y, sample_weight, training)
            )
        terms.update(self._checked_hook_terms(x, y, y_pred))
        return terms

    def _checked_hook_terms(
        self, x: Any, y: Any, y_pred: Any
    ) -> dict[str, tf.Tensor]:
        """Calls `regularization_losses` and checks what it returns."""
        terms = self.regularization_losses(x, y, y_pred)
        if not isinstance(terms, dict):
            raise ValueError(
                "`regularization_losses` must return a dict of name to "
                f"scalar tensor. Received: {type(terms).__name__} {terms!r}. "
                "Return for example {'smoothness': penalty}."
            )
        reserved = (
            _BUILT_IN_TERMS + _COMPONENT_NAMES + _LIBRARY_METRICS + ("loss",)
        )
        checked = {}
        for name, value in terms.items():
            if not isinstance(name, str) or name in reserved:
                raise ValueError(
                    "`regularization_losses` returned a term with an invalid "
                    f"name. Received: name={name!r}. Use a string other than "
                    f"{reserved}."
                )
            checked[name] = _validation.scalar_tensor(
                value, "The regularization term", name
            )
        return checked

    def _input_gradient_term(
        self, x: Any, y: Any, sample_weight: Any, training: bool
    ) -> tf.Tensor:
        """Returns the input-gradient penalty of this batch.

        A second forward pass, through the `forward_pass` hook, runs under a
        tape that watches the floating-point inputs. The per-sample
        gradients are those of the unweighted loss; the sample weights then
        weight each sample's penalty as Keras weights its loss.
        """
        labelled = keras.tree.flatten_with_path(x)
        inputs = [
            tensor
            for _, tensor in labelled
            if tensor is not None and tensor.dtype.is_floating
        ]
        if not inputs:
            received = ", ".join(
                f"{_input_label(path)} of dtype {tensor.dtype.name}"
                for path, tensor in labelled
                if tensor is not None
            )
            raise ValueError(
                "`input_gradient_penalty` needs at least one floating-point "
                f"input. Received inputs: {received}. Leave "
                "`input_gradient_penalty` off when every input is an "
                "integer, such as token ids."
            )
        weights = tf.nest.flatten(sample_weight)
        if len(weights) > 1:
            raise ValueError(
                "`input_gradient_penalty` needs one sample weight per sample, "
                "the same for every output. Received: sample_weight with "
                f"{len(weights)} entries. Pass a single array of sample "
                "weights."
            )
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y_pred = self.forward_pass(x, training=training)
            loss = super().compute_loss(x, y, y_pred, None, training=training)
            # Keras' unweighted loss is a mean over the replica's batch,
            # divided by the replica count; this is the sum of the
            # per-sample losses.
            summed = (
                loss
                * _keras_compat.batch_size(x, loss.dtype)
                * pipeline.replica_count()
            )
        gradients = tape.gradient(
            summed, inputs, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        return regularization.input_gradient_penalty(
            gradients,
            self.input_gradient_penalty_form,
            weights[0] if weights else None,
        )


def _input_label(path: tuple[Any, ...]) -> str:
    """Returns how to name an input in messages: `x`, `x[0]`, `x['ids']`."""
    return "x" + "".join(f"[{key!r}]" for key in path)
