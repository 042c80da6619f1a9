"""`GradientInspectionMixin`: per-layer gradient figures from the real step."""

import numpy as np
import tensorflow as tf

from custom_fit import _options
from custom_fit import _state
from custom_fit import _validation
from custom_fit import clipping
from custom_fit import inspection
from custom_fit.train_step import TrainStepMixin


class GradientInspectionMixin(TrainStepMixin):
    """Records per-layer gradient statistics inside the training step.

    The figures come from the gradients of the real step, as
    `transform_gradients` receives them: true (not loss-scaled, summed
    across replicas) and before clipping. They are computed in the graph
    and kept in non-trainable state, so nothing leaves the device until a
    callback reads them:

    - `model.gradient_norms`: dict of layer name to the joint L2 norm of that
      layer's gradients at the last inspected step. Keys are the entries of
      `model.layers` that own trainable variables (the model's own
      variables, if any, under the model's name).
    - `model.layer_gradient_statistics`: dict of statistic name to such a
      dict, for `"norm"` and each of `gradient_statistics`.
    - `model.layer_gradients` (with `keep_gradients=True`): dict of layer
      name to the list of its gradients as NumPy arrays, in
      `layer.trainable_variables` order.
    - `logs["grad_norm"]`: the global norm, as a running mean over the epoch
      like the loss; with a clipping mixin also `logs["grad_norm_clipped"]`,
      the global norm after clipping, to see how hard clipping bites.

    With `steps_per_execution > 1` the state holds the last inspected step.

    Args:
        gradient_statistics: List of extra per-layer statistics, from
            `"max_abs"` (largest |g|), `"zero_fraction"` (share of exact
            zeros: dead units), `"nonfinite_count"` (NaN/Inf entries) and
            `"update_ratio"` (norm of the applied update over the weight
            norm; costs a copy of the weights each inspected step).
            Defaults to none.
        inspect_every: Integer. Per-layer figures are recorded on steps
            whose optimizer iteration is a multiple of this. `grad_norm` is
            logged every step. Defaults to 1.
        keep_gradients: Bool. Keep the last inspected step's gradients for
            `model.layer_gradients` (memory: one copy of the trainable
            weights). Defaults to `False`.

    Example:

    ```python
    class Net(custom_fit.GradientInspectionMixin, keras.Model):
        pass

    class PrintNorms(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print(batch, self.model.gradient_norms)

    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3)(inputs)
    model = Net(inputs, outputs, gradient_statistics=["zero_fraction"])
    model.compile(optimizer="sgd", loss="mse")
    ```
    """

    gradient_statistics = _options.Option(
        (), _validation.subset_of(inspection.STATISTICS)
    )
    inspect_every = _options.Option(1, _validation.positive_int_or_none)
    keep_gradients = _options.Option(False, _validation.boolean)

    def _configure_options(self, options):
        """Refuses `inspect_every=None`: a step frequency is needed."""
        super()._configure_options(options)
        if self.inspect_every is None:
            raise ValueError(
                "`inspect_every` must be an integer >= 1. Received: "
                "inspect_every=None. Pass inspect_every=1 to inspect every "
                "step."
            )
        if "_inspection_state" not in self.__dict__:
            self.__dict__["_inspection_state"] = {}
            self.__dict__["_kept_gradients"] = []
            self.__dict__["_inspected_layers"] = []

    # Reading the state (host side).

    @property
    def gradient_norms(self):
        """Dict of layer name to gradient norm at the last inspected step."""
        return self.layer_gradient_statistics.get("norm", {})

    @property
    def layer_gradient_statistics(self):
        """Dict of statistic name to a dict of layer name to value."""
        return {
            name: dict(
                zip(
                    self._inspected_layers,
                    (float(v) for v in variable.numpy()),
                )
            )
            for name, variable in self._inspection_state.items()
        }

    @property
    def layer_gradients(self):
        """Dict of layer name to the list of its last inspected gradients."""
        if not self.keep_gradients:
            raise AttributeError(
                "`layer_gradients` needs the model built with "
                "keep_gradients=True. Received: keep_gradients=False. Pass "
                "keep_gradients=True to the model's constructor."
            )
        layers = {}
        for owner, variable in self._kept_gradients:
            layers.setdefault(owner, []).append(np.array(variable.numpy()))
        return layers

    # In the step.

    def inspect_gradients(
        self, gradients, transformed_gradients, variables, optimizer=None
    ):
        """Logs the global norms and records the per-layer statistics."""
        super().inspect_gradients(
            gradients, transformed_gradients, variables, optimizer=optimizer
        )
        owners = self.layer_names_of(variables)
        self._create_inspection_state(owners, variables)
        layers = self._inspected_layers
        if self.inspect_every == 1:
            # Every layer is a group: the global norm follows from theirs,
            # which saves a pass over the gradients.
            layer_norms = inspection.group_norms(gradients, owners, layers)
            global_norm = tf.sqrt(tf.reduce_sum(tf.square(layer_norms)))
        else:
            layer_norms = None
            global_norm = clipping.global_norm(gradients)
        self.report_metric("grad_norm", global_norm)
        if self._clips_gradients():
            self.report_metric(
                "grad_norm_clipped", clipping.global_norm(transformed_gradients)
            )

        def record():
            for name, variable in self._inspection_state.items():
                if name == "norm" and layer_norms is not None:
                    variable.assign(layer_norms)
                elif name in inspection.GROUP_STATISTICS:
                    function = inspection.GROUP_STATISTICS[name]
                    variable.assign(function(gradients, owners, layers))
            for (_, kept), g in zip(self._kept_gradients, gradients):
                if g is not None:
                    kept.assign(tf.cast(tf.convert_to_tensor(g), kept.dtype))

        self._on_inspected_steps(record, optimizer)

    def apply_gradients(
        self, gradients, variables, finite=None, optimizer=None
    ):
        """Applies the gradients; records update ratios if requested."""
        if "update_ratio" not in self.gradient_statistics:
            return super().apply_gradients(
                gradients, variables, finite, optimizer=optimizer
            )
        before = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        super().apply_gradients(
            gradients, variables, finite, optimizer=optimizer
        )
        after = [tf.convert_to_tensor(v) for v in variables]
        owners = self.layer_names_of(variables)

        def record():
            self._inspection_state["update_ratio"].assign(
                inspection.update_ratios(
                    before, after, owners, self._inspected_layers
                )
            )

        self._on_inspected_steps(record, optimizer)

    def _on_inspected_steps(self, record, optimizer):
        """Runs `record` on the steps selected by `inspect_every`.

        The step is the update count of `optimizer` (by default the
        model's).
        """
        if self.inspect_every == 1:
            record()
            return
        step = (optimizer or self.optimizer).iterations
        tf.cond(
            tf.equal(step % self.inspect_every, 0),
            lambda: record() or tf.constant(True),
            lambda: tf.constant(False),
        )

    def _create_inspection_state(self, owners, variables):
        """Creates the state variables on first use, outside the trace.

        They are `ON_READ` variables, so replicas write them without
        synchronising and a read returns the first replica's values (all
        replicas hold the same, summed gradients).
        """
        if self._inspection_state:
            return
        layers = list(dict.fromkeys(owners))
        self._inspected_layers.extend(layers)
        names = ("norm",) + tuple(self.gradient_statistics)
        with tf.init_scope():
            for name in names:
                self._inspection_state[name] = _state.local_variable(
                    tf.zeros(len(layers)), name
                )
            if self.keep_gradients:
                for owner, variable in zip(owners, variables):
                    self._kept_gradients.append(
                        (
                            owner,
                            _state.local_variable(
                                tf.zeros(variable.shape, tf.float32),
                                "kept_gradient",
                            ),
                        )
                    )
