"""custom_fit's own state: variables made per backend, and their holder.

The mixins keep figures between steps (inspection state, gradient sums of
accumulation, the consecutive-skip counter). They are made by the backend
adapter: plain `ON_READ` `tf.Variable`s on TensorFlow (each replica writes
its own copy), Keras variables on JAX. On JAX, everything a step changes
must travel in the step's state; Keras carries the variables of the
model's metrics there, so each model lists its state in one
`StateHolder`, a metric that logs nothing and that `reset_metrics()`
leaves alone.
"""

from collections.abc import Sequence
from typing import Any

import keras

from custom_fit import backend
from custom_fit._types import Variable


def state_variable(
    shape: Sequence[int], dtype: str, name: str, summed: bool = False
) -> Any:
    """Returns a zero-initialized variable for custom_fit's own state.

    Args:
        shape: The variable's shape.
        dtype: Its dtype.
        name: Its name.
        summed: Bool. Under `tf.distribute`, a read sums the replicas'
            copies (metric totals) instead of taking the first one.

    Returns:
        A variable of the backend in use.
    """
    return backend.current().state_variable(tuple(shape), dtype, name, summed)


class StateHolder(keras.metrics.Metric):
    """Lists a model's custom_fit state so that it travels with the step.

    It is one of the model's metrics (so Keras carries its variables in the
    state of a JAX step and writes them back), but it reports nothing and
    is not reset between epochs. Optimizers that update networks of the
    model through `minimize` are listed here too: their variables are part
    of the step's state as well.
    """

    def __init__(self) -> None:
        super().__init__(name="custom_fit_state")
        self._state: list[Variable] = []
        self._optimizers: list[keras.optimizers.Optimizer] = []

    def track(self, variable: Variable) -> None:
        """Adds a state variable."""
        self._state.append(variable)

    def track_optimizer(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Adds an optimizer whose variables the step updates."""
        if all(optimizer is not known for known in self._optimizers):
            self._optimizers.append(optimizer)

    @property
    def variables(self) -> list[Variable]:
        """The state variables, then those of the tracked optimizers."""
        found = list(self._state)
        for optimizer in self._optimizers:
            found.extend(optimizer.variables)
        return [v for v in found if isinstance(v, keras.Variable)]

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Does nothing: the state is written by the mixins."""
        del args, kwargs

    def reset_state(self) -> None:
        """Does nothing: the state outlives epochs."""

    def result(self) -> dict[str, Any]:
        """Returns no log entry."""
        return {}
