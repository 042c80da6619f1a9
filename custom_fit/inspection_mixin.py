"""`GradientInspectionMixin`: per-layer gradient figures from the real step."""

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import numpy as np
from keras import ops

from custom_fit import _figures
from custom_fit import _gradient_ops
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _slots
from custom_fit import _validation
from custom_fit import backend
from custom_fit import inspection
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor
from custom_fit._types import Variable
from custom_fit.train_step_mixin import TrainStepMixin

# Relative difference below which two float32 norms of the same gradients,
# summed in different orders, count as equal.
_ROUNDING = 1e-5


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
      `layer.trainable_variables` order. With several processes, a
      gradient split over devices of other processes (a kernel laid out
      along a model axis that spans hosts) is gathered from every process:
      every process must read it at the same point, as callbacks do (not
      in process 0 alone).
    - `logs["grad_norm"]`: the global norm, as a running mean over the
      epoch's steps, each step counted once (the loss, unlike it, weights
      each batch by its size); `logs["grad_norm_step"]`: the global norm
      of the step itself, in batch logs only (a batch-level callback sees
      each step's, which a running mean hides; epoch logs and History
      leave it out: the last batch's value is no epoch figure); with a
      clipping mixin also `logs["grad_norm_clipped"]`, the global norm
      after clipping (after `transform_gradients`), to see
      how hard clipping bites, and `logs["clip_rate"]`, the share of the
      epoch's steps in which clipping lowered the norm: how often it bites.

    With `steps_per_execution > 1` the state holds the last inspected step.

    Args:
        gradient_statistics: List of extra per-layer statistics, from
            `"max_abs"` (largest |g|), `"zero_fraction"` (share of exact
            zeros: dead units), `"nonfinite_count"` (NaN/Inf entries) and
            `"update_ratio"` (norm of the applied update over the weight
            norm; costs a copy of the weights each inspected step).
            Defaults to none.
        inspect_every: Integer from 1 to 2**31 - 1. Per-layer figures are
            recorded on steps whose optimizer iteration is a multiple of
            this. `grad_norm` is logged every step. Defaults to 1.
        keep_gradients: Bool. Keep the last inspected step's gradients for
            `model.layer_gradients` (memory: one copy of the trainable
            weights). Defaults to `False`.
        layer_norms_in_logs: Bool. Also log each layer's gradient norm,
            under `grad_norm/<layer>` (a running mean over the epoch's
            steps, like `grad_norm`), so that `CSVLogger`,
            `keras.callbacks.TensorBoard` and any logger reading `logs` get
            them. Defaults to `False`.

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

    reports = ("grad_norm", "grad_norm_step", "grad_norm_clipped", "clip_rate")
    groups_by_layer = True  # `layer_depth` applies to its figures

    gradient_statistics = _options.Option(
        (), _validation.subset_of(inspection.STATISTICS)
    )
    inspect_every = _options.Option(1, _validation.positive_int)
    keep_gradients = _options.Option(False, _validation.boolean)
    _kept_gradients = _slots.Slots("float32", requires=("keep_gradients",))
    # Per set of inspected variables (keyed by their ids): each statistic's
    # vector of one figure per layer, and the set's marks.
    _inspection_figures = _slots.Buffers("float32")
    _inspection_marks = _slots.Buffers("int32")
    layer_norms_in_logs = _options.Option(False, _validation.boolean)

    # Reading the state (host side).

    @property
    def gradient_norms(self) -> dict[str, float]:
        """Dict of layer name to gradient norm at the last inspected step."""
        state = self._current_inspection_state()
        return state.read("norm") if state else {}

    @property
    def layer_gradient_statistics(self) -> dict[str, dict[str, float]]:
        """Dict of statistic name to a dict of layer name to value."""
        state = self._current_inspection_state()
        if state is None:
            return {}
        return {name: state.read(name) for name in state.figures}

    @property
    def layer_gradients(self) -> dict[str, list[np.ndarray]]:
        """Dict of layer name to the list of its last inspected gradients.

        Raises:
            ValueError: Without `keep_gradients=True`. (Not an
                `AttributeError`: on PyTorch, `torch.nn.Module` would
                replace its message by a plain "no attribute".)
        """
        if not self.keep_gradients:
            raise ValueError(
                "`layer_gradients` needs the model built with "
                "keep_gradients=True. Received: keep_gradients=False. Pass "
                "keep_gradients=True to the model's constructor."
            )
        state = self._current_inspection_state()
        layers: dict[str, list[np.ndarray]] = {}
        if state is None:
            return layers
        for owner, variable in state.kept:
            layers.setdefault(owner, []).append(state.value(variable))
        return layers

    @property
    def inspected_step(self) -> int:
        """The training step of the figures: 0 before the first inspection.

        It is the optimizer's update count after the inspected step
        (`optimizer.iterations`, 1-based), so with `inspect_every=N` it
        moves by N, and with gradient accumulation it counts updates.
        """
        state = self._current_inspection_state()
        return int(state.value(state.marks)[0]) if state else 0

    @property
    def inspection_mark(self) -> tuple[int, int]:
        """What tells the figures of one inspected step from another's.

        A pair `(id of the inspected variable set, count of inspected
        steps)`: it changes with each newly inspected step, and when the
        model trains another set of variables (a layer frozen or unfrozen:
        a state of its own, whose count starts again). A callback compares
        it with the pair it saw last to know whether the figures are new.
        """
        state = self._current_inspection_state()
        if state is None:
            return (0, 0)
        return (id(state), int(state.value(state.marks)[1]))

    def _current_inspection_state(self) -> "_InspectionState | None":
        """Returns the state of the last traced step, or `None`.

        There is one state per set of inspected variables (freezing a layer
        and compiling again changes the set); the last traced one is read.
        """
        record = _model_state.record_of(self, _RECORD, _InspectionRecord)
        return record.states.get(record.last)

    # In the step.

    def inspect_gradients(
        self,
        gradients: Gradients,
        transformed_gradients: Gradients,
        variables: Sequence[Variable],
        optimizer: Optimizer | None = None,
    ) -> None:
        """Logs the global norms and records the per-layer statistics."""
        super().inspect_gradients(
            gradients, transformed_gradients, variables, optimizer=optimizer
        )
        owners = self.layer_names_of(variables)
        state = self._inspection_state(owners, variables)
        # Every variable belongs to one layer: the update's figures (one
        # pass over the gradients, shared) give the layers' norms and the
        # global norm.
        figures = _figures.of(self, gradients)
        layer_norms = ops.sqrt(figures.group_squares(owners, state.layers))
        global_norm = figures.norm
        self.report_metric("grad_norm", global_norm)
        # The step's own figure, for batch-level callbacks (spikes).
        # Not held: a skipped step's own figure (NaN) is what it shows.
        self._report(
            "grad_norm_step", global_norm, reduction="step", held=False
        )
        if self.layer_norms_in_logs:
            for index, layer in enumerate(state.layers):
                self.report_metric(f"grad_norm/{layer}", layer_norms[index])
        if _options.any_set(self, "clipping"):
            clipped_norm = _figures.of(self, transformed_gradients).norm
            self.report_metric("grad_norm_clipped", clipped_norm)
            # Every clipping only scales down, so it bit if the norm fell
            # (beyond the rounding of two summation orders).
            bit = clipped_norm < global_norm * (1.0 - _ROUNDING)
            self.report_metric("clip_rate", ops.cast(bit, "float32"))
        optimizer = optimizer or self.optimizer

        def record() -> None:
            for name, variable in state.figures.items():
                if name == "norm":
                    variable.assign(layer_norms)
                elif name in inspection.GROUP_STATISTICS:
                    function = inspection.GROUP_STATISTICS[name]
                    variable.assign(function(gradients, owners, state.layers))
            for (_, kept), g in zip(state.kept, gradients):
                if g is not None:
                    kept.assign(ops.cast(_gradient_ops.dense(g), kept.dtype))
            # The step inspected and the count of inspected steps, in one.
            iterations = ops.cast(optimizer.iterations, "int32")
            count = backend.current().read(state.marks)[1]
            state.marks.assign(ops.stack([iterations + 1, count + 1]))

        self._run_when(self._is_inspected_step(optimizer), record)

    def apply_gradients(
        self,
        gradients: Gradients,
        variables: Sequence[Variable],
        finite: Tensor | None = None,
        optimizer: Optimizer | None = None,
    ) -> None:
        """Applies the gradients; records update ratios if requested.

        The ratio of a step that `skip_nonfinite` skips is 0 (no update).
        """
        if "update_ratio" not in self.gradient_statistics:
            return super().apply_gradients(
                gradients, variables, finite, optimizer=optimizer
            )
        # Decided before the update moves `optimizer.iterations`, so the
        # ratio belongs to the same step as the other figures.
        selected = self._is_inspected_step(optimizer or self.optimizer)
        before = [backend.current().copy(v) for v in variables]
        super().apply_gradients(
            gradients, variables, finite, optimizer=optimizer
        )
        after = [backend.current().read(v) for v in variables]
        owners = self.layer_names_of(variables)
        state = self._inspection_state(owners, variables)

        def record() -> None:
            state.figures["update_ratio"].assign(
                inspection.update_ratios(before, after, owners, state.layers)
            )

        self._run_when(selected, record)

    def _is_inspected_step(self, optimizer: Optimizer) -> bool | Tensor:
        """Returns `True`, or a boolean tensor: whether to record this step.

        Steps are counted by `optimizer.iterations` (updates).
        """
        if self.inspect_every == 1:
            return True
        iterations = ops.convert_to_tensor(optimizer.iterations)
        return ops.equal(iterations % self.inspect_every, 0)

    def _run_when(
        self, selected: bool | Tensor, record: Callable[[], None]
    ) -> None:
        """Runs `record` now if `selected` is `True`, else when it holds.

        In a conditional branch the reports are made in the branch.
        """
        if selected is True:
            record()
            return
        backend.current().run_if(
            selected, _model_state.state_of(self).metrics.in_branch(record)
        )

    def _inspection_state(
        self, owners: Sequence[str], variables: Sequence[Variable]
    ) -> "_InspectionState":
        """Returns the state of `variables`, created on first use.

        See `_InspectionState`.
        """
        record = _model_state.record_of(self, _RECORD, _InspectionRecord)
        key = tuple(id(variable) for variable in variables)
        if key not in record.states:
            record.states[key] = _InspectionState(
                self,
                key,
                owners,
                variables,
                ("norm",) + tuple(self.gradient_statistics),
                self.keep_gradients,
            )
        record.last = key
        return record.states[key]


# The key of inspection's record in a model's state (`record_of`).
_RECORD = "GradientInspectionMixin"


@dataclasses.dataclass
class _InspectionRecord:
    """What inspection keeps of a model on the host.

    Attributes:
        states: Dict of a variable set's key (the variables' ids) to its
            `_InspectionState`.
        last: The key of the last traced set, or `None`.
    """

    states: dict[tuple[int, ...], "_InspectionState"] = dataclasses.field(
        default_factory=dict
    )
    last: tuple[int, ...] | None = None


class _InspectionState:
    """The recorded figures of one set of variables, kept on the device.

    They are custom_fit state variables (`custom_fit._state`): under
    `tf.distribute` each replica writes its own copy and a read returns the
    first replica's (all replicas hold the same, summed gradients); on JAX
    they travel with the step.

    Attributes:
        layers: The layer names, in order of first appearance.
        figures: Dict of statistic name to a vector with one value per
            layer.
        kept: List of `(layer name, variable)` holding the last gradients,
            aligned with the inspected variables (empty unless kept).
        marks: Int32 vector: `optimizer.iterations` after the last
            inspected step, and the number of inspected steps.
    """

    def __init__(
        self,
        model: Any,
        key: tuple[int, ...],
        owners: Sequence[str],
        variables: Sequence[Variable],
        statistics: Sequence[str],
        keep_gradients: bool,
    ) -> None:
        self._model = model
        self.layers = list(dict.fromkeys(owners))
        self.figures = {
            name: model._inspection_figures.variable(
                (len(self.layers),), key=(key, name)
            )
            for name in statistics
        }
        # The last gradients: the model's declared slots (one per
        # variable, whoever inspects it).
        self.kept = (
            list(zip(owners, model._kept_gradients.of(variables)))
            if keep_gradients
            else []
        )
        self.marks = model._inspection_marks.variable((2,), key=key)

    def value(self, variable: Any) -> np.ndarray:
        """Returns a state variable's value on the host."""
        return backend.current().host_value(self._model, variable)

    def read(self, name: str) -> dict[str, float]:
        """Returns the figure `name` as a dict of layer name to float."""
        values = self.value(self.figures[name])
        return dict(zip(self.layers, (float(v) for v in values)))
