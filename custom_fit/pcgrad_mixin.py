"""`PCGradMixin`: gradient surgery between the losses of a multi-task model."""

import dataclasses
from collections.abc import Sequence

import keras
from keras import ops

from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _slots
from custom_fit import _validation
from custom_fit import backend
from custom_fit import pcgrad
from custom_fit._types import Gradients
from custom_fit._types import Variable
from custom_fit.train_step_mixin import TrainStepMixin

# The key of PCGrad's record in a model's state (`record_of`).
_RECORD = "PCGradMixin"


@dataclasses.dataclass
class _LastOrder:
    """What PCGrad keeps of a model on the host.

    Attributes:
        tasks: The task count of the last traced step (the key of its
            order among the `_last_order` buffers), or `None`.
    """

    tasks: int | None = None


class PCGradMixin(TrainStepMixin):
    """Projects conflicting task gradients (PCGrad, Yu et al. 2020).

    Each output of a multi-output model is a task: its compiled loss is
    differentiated on its own (one backward pass per task, after one
    forward pass), and each task's true gradient, flattened over all
    trainable variables, is projected onto the normal plane of every other
    task's gradient it conflicts with (negative dot product), the other
    tasks taken in a random order, against their original gradients. The
    update is the sum of the projected gradients (see
    `custom_fit.pcgrad.project_conflicting`), which then goes through the
    rest of the pipeline (clipping, inspection, the guard). The rest of the
    loss (`model.losses`, penalties) is added unprojected, unless
    `per_loss_gradients="outputs_and_penalties"` makes each named penalty a
    task too.

    With two tasks the order does not matter; with more, it is drawn at
    every step from a seeded generator kept in the model's state
    (`model.task_order` holds the last step's). Costs: one backward pass per
    task, and a few vector operations per pair of tasks.

    Args:
        per_loss_gradients: `"outputs"` (default) or
            `"outputs_and_penalties"`; see `TrainStepMixin`.
        pcgrad_seed: Integer or `None`. Seed of the task order.

    Example:

    ```python
    class Net(custom_fit.PCGradMixin, keras.Model):
        pass

    inputs = keras.Input((8,))
    shared = keras.layers.Dense(16, activation="relu")(inputs)
    model = Net(inputs, {"a": keras.layers.Dense(1, name="a")(shared),
                         "b": keras.layers.Dense(1, name="b")(shared)})
    model.compile(optimizer="adam", loss={"a": "mse", "b": "mse"})
    ```

    Reference:
        [Yu et al., 2020](https://arxiv.org/abs/2001.06782), "Gradient
        Surgery for Multi-Task Learning".
    """

    per_loss_gradients = _options.Option(
        "outputs", _validation.one_of(("outputs", "outputs_and_penalties"))
    )
    pcgrad_seed = _options.Option(None, _validation.seed_or_none)
    # The generator of each step's task order.
    _order_seeds = _options.Seeds("pcgrad_seed")
    # The last step's order (its length, the number of tasks, is known at
    # the first step).
    _last_order = _slots.Buffers("int32")

    @property
    def task_order(self) -> list[int]:
        """The order of the tasks at the last step (indices of the losses)."""
        record = _model_state.state_of(self).records.get(_RECORD)
        order = None if record is None else self._last_order.get(record.tasks)
        if order is None:
            return []
        return [int(i) for i in backend.current().host_value(self, order)]

    def combine_gradients(
        self,
        gradients_by_loss: dict[str, Gradients],
        variables: Sequence[Variable],
    ) -> Gradients:
        """Returns the PCGrad update of the tasks, plus the rest of the loss.

        Args:
            gradients_by_loss: Dict of loss name to true gradients.
            variables: The variables.

        Returns:
            A list of gradients aligned with `variables`.
        """
        tasks = {
            name: gradients
            for name, gradients in gradients_by_loss.items()
            if name != "regularization"
        }
        count = len(tasks)
        # One order per task count: a model compiled again with other
        # losses keeps its step's own (the last traced one is shown).
        last = self._last_order.variable((count,), key=count)
        _model_state.record_of(self, _RECORD, _LastOrder).tasks = count
        order = ops.cast(
            keras.random.shuffle(ops.arange(count), seed=self._order_seeds),
            "int32",
        )
        last.assign(order)
        combined = pcgrad.project_conflicting(list(tasks.values()), order)
        rest = gradients_by_loss.get("regularization")
        if rest is None:
            return combined
        return super().combine_gradients(
            {"tasks": combined, "regularization": rest}, variables
        )
