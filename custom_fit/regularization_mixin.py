"""`RegularizationMixin`: named loss components, penalties, as metrics."""

from typing import Any

import keras
from keras import ops

from custom_fit import _gradient_ops
from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _validation
from custom_fit import backend
from custom_fit import regularization
from custom_fit._types import Scalar
from custom_fit._types import Tensor
from custom_fit._types import Variable
from custom_fit.train_step_mixin import TrainStepMixin


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
            component) of the trainable variables that `l1` and `l2` act
            on, or `None` (the default) for every trainable weight matrix
            (`custom_fit.regularization.is_weight_matrix`): every variable
            of two or more dimensions but biases, normalization scales and
            offsets and `PReLU`'s slopes; so kernels, recurrent kernels
            (`LSTM`, `GRU`, `SimpleRNN`, `ConvLSTM`), depthwise and
            pointwise kernels, embeddings, LoRA factors and a custom
            layer's matrices, the weights Keras' layers regularize with
            `kernel_regularizer`, `recurrent_regularizer`,
            `embeddings_regularizer`, `depthwise_regularizer` and
            `pointwise_regularizer`. Pass for example
            `["kernel", "bias"]` to choose by name. Under LoRA the kernels
            being adapted are frozen (not trainable) and never penalized:
            the penalty acts on the factors that train, `A` and `B`
            (`l2 * (sum(A**2) + sum(B**2))`), not on the merged kernel
            `W + A @ B` (penalize that in `regularization_losses` if you
            need it).
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

    reports = (
        "data_loss",
        "regularization_loss",
        "l1_penalty",
        "l2_penalty",
        "input_gradient_penalty",
        "l1_weight",
        "l2_weight",
        "input_gradient_penalty_weight",
    )

    l1 = _options.Option(
        None,
        _validation.positive_float_or_none,
        bound=True,
        schedulable=True,
        logged_as="l1_weight",
    )
    l2 = _options.Option(
        None,
        _validation.positive_float_or_none,
        bound=True,
        schedulable=True,
        logged_as="l2_weight",
    )
    penalized_variable_names = _options.Option(
        None,
        _validation.names_or_none,
        requires=("l1", "l2"),
        # The list of names that was the default before the weight-matrix
        # rule (a model saved then keeps it where l1 or l2 is set).
        former_defaults=(
            (
                "kernel",
                "embeddings",
                "depthwise_kernel",
                "lora_kernel_a",
                "lora_kernel_b",
                "lora_embeddings_a",
                "lora_embeddings_b",
            ),
        ),
    )
    input_gradient_penalty = _options.Option(
        None,
        _validation.positive_float_or_none,
        bound=True,
        schedulable=True,
        logged_as="input_gradient_penalty_weight",
    )
    input_gradient_penalty_form = _options.Option(
        "squared_norm",
        _validation.one_of(regularization.INPUT_GRADIENT_FORMS),
        requires=("input_gradient_penalty",),
    )

    def _configure_options(self, options: dict[str, Any]) -> None:
        """Checks `penalized_variable_names` when the variables are known."""
        super()._configure_options(options)
        if self.built and self.trainable_variables:
            self._penalized_variables()

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
    ) -> Tensor:
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
        state = _model_state.state_of(self)
        # `minimize` in the same step must not add the penalties again.
        state.local.penalized_at = state.generation
        replicas = backend.current().replica_count()
        batch_size = _keras_compat.batch_size(x, total.dtype)
        unscaled_total = total * replicas if replicas > 1 else total
        model_losses = [
            ops.sum(ops.cast(loss, total.dtype)) for loss in self.losses
        ]
        if model_losses:
            regularization_loss = _gradient_ops.add_all(model_losses)
            self.report_metric(
                "regularization_loss", regularization_loss, batch_size
            )
            # Not `-=`: on PyTorch that would change `total` in place.
            unscaled_total = unscaled_total - regularization_loss
        self.report_metric("data_loss", unscaled_total, batch_size)
        terms = self._penalties(x, y, y_pred, sample_weight, training)
        added = {}
        for name, value in terms.items():
            self.report_metric(name, value, batch_size)
            value = ops.cast(value, total.dtype)
            added[name] = value / replicas if replicas > 1 else value
            total = total + added[name]
        # `per_loss_gradients="outputs_and_penalties"` differentiates each.
        state.local.loss_terms = added
        return total

    def _penalties(
        self,
        x: Any,
        y: Any,
        y_pred: Any,
        sample_weight: Any,
        training: bool,
    ) -> dict[str, Tensor]:
        """Returns the keyword penalties and the hook's terms, checked."""
        terms = self._weight_penalties()
        if self.input_gradient_penalty is not None:
            terms["input_gradient_penalty"] = self.option_in_step(
                "input_gradient_penalty"
            ) * self._input_gradient_term(x, y, sample_weight, training)
        terms.update(self._checked_hook_terms(x, y, y_pred))
        return terms

    def _weight_penalties(self) -> dict[str, Tensor]:
        """Returns the `l1` and `l2` penalties that are set."""
        terms: dict[str, Tensor] = {}
        if self.l1 is None and self.l2 is None:
            return terms
        penalized = self._penalized_variables()
        if self.l1 is not None:
            terms["l1_penalty"] = regularization.l1_penalty(
                penalized, self.option_in_step("l1")
            )
        if self.l2 is not None:
            terms["l2_penalty"] = regularization.l2_penalty(
                penalized, self.option_in_step("l2")
            )
        return terms

    def _penalized_variables(self) -> list[Variable]:
        """Returns the variables `l1` and `l2` act on; refuses an empty set."""
        variables = self.trainable_variables
        penalized = regularization.select_variables(
            variables, self.penalized_variable_names
        )
        if (self.l1 is not None or self.l2 is not None) and not penalized:
            if self.penalized_variable_names is None:
                raise ValueError(
                    "l1 and l2 act on the model's trainable weight matrices "
                    "(variables of two or more dimensions but biases, "
                    "normalization scales and offsets), and this model has "
                    "none. Received: l1="
                    f"{self.l1!r}, l2={self.l2!r} on trainable variables "
                    f"{[regularization.variable_name(v) for v in variables]}"
                    ". Name the variables to penalize with "
                    "penalized_variable_names=[...]."
                )
            _validation.known_names(
                "penalized_variable_names",
                self.penalized_variable_names,
                [regularization.variable_name(v) for v in variables],
                "variables",
            )
        return penalized

    def _add_penalties(self, loss: Tensor, penalty_inputs: Any) -> Tensor:
        """Adds this network's penalties to a loss that `minimize` receives.

        A loss from this model's `compute_loss` in the same step holds them
        already and is returned as is. Otherwise (a network updated in
        another model's step, or in a hand-written loop) the keyword
        penalties are added, divided by the replica count as in
        `compute_loss`, and reported under the network's name. The
        `regularization_losses` hook needs a batch and runs only in
        `compute_loss`.
        """
        state = _model_state.state_of(self)
        if getattr(state.local, "penalized_at", None) == state.generation:
            state.local.penalized_at = None
            return super()._add_penalties(loss, penalty_inputs)
        terms = self._weight_penalties()
        if self.input_gradient_penalty is None:
            super()._add_penalties(loss, penalty_inputs)  # refuses inputs
        elif penalty_inputs is None:
            raise ValueError(
                f"The network {self.name!r} has input_gradient_penalty="
                f"{self.input_gradient_penalty}, taken at inputs that the "
                "caller of `minimize` names. Received: penalty_inputs=None. "
                "Pass the inputs, e.g. `minimize(loss_function, "
                "optimizer=..., penalty_inputs=interpolated)` for WGAN-GP."
            )
        else:
            terms["input_gradient_penalty"] = self.option_in_step(
                "input_gradient_penalty"
            ) * self._output_gradient_term(penalty_inputs)
        replicas = backend.current().replica_count()
        for name, value in terms.items():
            self.report_metric(name, value)
            value = ops.cast(value, loss.dtype)
            loss = loss + (value / replicas if replicas > 1 else value)
        return loss

    def _output_gradient_term(self, inputs: Any) -> Tensor:
        """Returns the penalty on the gradient of the outputs at `inputs`.

        The per-sample gradient of the network's output (its entries
        summed) with respect to its inputs: WGAN-GP's critic gradient when
        the output is one score per sample.
        """
        _, watched, inputs = self._differentiable_inputs(inputs)

        def summed_outputs(values: list[Tensor]) -> Tensor:
            outputs = self.forward_pass(self._with_inputs(inputs, values), True)
            return _gradient_ops.add_all(
                [
                    ops.sum(ops.cast(output, "float32"))
                    for output in keras.tree.flatten(outputs)
                ]
            )

        gradients = backend.current().input_gradients(summed_outputs, watched)
        return regularization.input_gradient_penalty(
            gradients, self.input_gradient_penalty_form
        )

    def _differentiable_inputs(
        self, x: Any
    ) -> tuple[list[tuple[Any, Any]], list[Tensor], Any]:
        """Returns the inputs to differentiate, cast as the model takes them.

        An input counts when the model's own input of that position is
        floating point (Keras casts integer data to a float `Input`), or,
        when the model's inputs are not known (a subclassed model), when
        the data is floating point.

        Returns:
            A tuple `(labelled, watched, x)`: the flattened `(path, tensor)`
            pairs of `x`, the floating tensors to watch, and `x` rebuilt
            with those tensors.

        Raises:
            ValueError: If no input is floating point.
        """
        labelled = keras.tree.flatten_with_path(x)
        declared = getattr(self, "inputs", None) or []
        dtypes: list[Any] = [None] * len(labelled)
        if len(declared) == len(labelled):
            dtypes = [getattr(t, "dtype", None) for t in declared]
        flat, watched = [], []
        for (_, tensor), dtype in zip(labelled, dtypes):
            if tensor is not None:
                tensor = ops.convert_to_tensor(tensor)
                target = keras.backend.standardize_dtype(dtype or tensor.dtype)
                if "float" in target:
                    tensor = ops.cast(tensor, target)
                    watched.append(tensor)
            flat.append(tensor)
        if not watched:
            received = ", ".join(
                f"{_input_label(path)} of dtype "
                f"{keras.backend.standardize_dtype(tensor.dtype)}"
                for path, tensor in labelled
                if tensor is not None
            )
            raise ValueError(
                "`input_gradient_penalty` needs at least one floating-point "
                f"input. Received inputs: {received}. Leave "
                "`input_gradient_penalty` off when every input is an "
                "integer, such as token ids."
            )
        return labelled, watched, keras.tree.pack_sequence_as(x, flat)

    @staticmethod
    def _with_inputs(x: Any, values: list[Tensor]) -> Any:
        """Returns `x` with its floating-point inputs replaced by `values`.

        `values` are the watched inputs of `_differentiable_inputs`, in
        order; the other inputs stay as they are.
        """
        replacements = iter(values)
        flat = [
            next(replacements)
            if t is not None
            and "float" in keras.backend.standardize_dtype(t.dtype)
            else t
            for t in keras.tree.flatten(x)
        ]
        return keras.tree.pack_sequence_as(x, flat)

    def _checked_hook_terms(
        self, x: Any, y: Any, y_pred: Any
    ) -> dict[str, Tensor]:
        """Calls `regularization_losses` and checks what it returns."""
        terms = self.regularization_losses(x, y, y_pred)
        if not isinstance(terms, dict):
            raise ValueError(
                "`regularization_losses` must return a dict of name to "
                f"scalar tensor. Received: {type(terms).__name__} {terms!r}. "
                "Return for example {'smoothness': penalty}."
            )
        reserved = _options.declared_reports(type(self)) + ("loss",)
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
    ) -> Tensor:
        """Returns the input-gradient penalty of this batch.

        A second forward pass, through the `forward_pass` hook, runs under a
        tape that watches the floating-point inputs. The per-sample
        gradients are those of the unweighted loss; the sample weights then
        weight each sample's penalty as Keras weights its loss.
        """
        _, inputs, x = self._differentiable_inputs(x)
        weights = keras.tree.flatten(sample_weight)
        if len(weights) > 1:
            raise ValueError(
                "`input_gradient_penalty` needs one sample weight per sample, "
                "the same for every output. Received: sample_weight with "
                f"{len(weights)} entries. Pass a single array of sample "
                "weights."
            )

        def summed_loss(values: list[Tensor]) -> Tensor:
            inputs = self._with_inputs(x, values)
            y_pred = self.forward_pass(inputs, training=training)
            loss = super(RegularizationMixin, self).compute_loss(
                inputs, y, y_pred, None, training=training
            )
            # Keras' unweighted loss is a mean over the replica's batch,
            # divided by the replica count; this is the sum of the
            # per-sample losses.
            return (
                loss
                * _keras_compat.batch_size(x, loss.dtype)
                * backend.current().replica_count()
            )

        gradients = backend.current().input_gradients(summed_loss, inputs)
        return regularization.input_gradient_penalty(
            gradients,
            self.input_gradient_penalty_form,
            weights[0] if weights else None,
        )


def _input_label(path: tuple[Any, ...]) -> str:
    """Returns how to name an input in messages: `x`, `x[0]`, `x['ids']`."""
    return "x" + "".join(f"[{key!r}]" for key in path)
