"""custom_fit's own state: variables made per backend, and their holder.

The mixins keep figures between steps (inspection state, gradient sums of
accumulation, the consecutive-skip counter). They are made by the backend
adapter: plain `ON_READ` `tf.Variable`s on TensorFlow (each replica writes
its own copy), Keras variables on JAX. On JAX, everything a step changes
must travel in the step's state: the JAX adapter carries custom_fit's
state beside Keras' own, and each model lists it in one `StateHolder`.
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


def state_like(weight: Variable, dtype: str, name: str) -> Any:
    """Returns a zero-initialized state variable shaped as `weight` is.

    Every weight-shaped variable custom_fit keeps (gradient sums of
    accumulation, kept gradients) is made here, with the weight's shape and
    layout: under `keras.distribution.ModelParallel` it is sharded as its
    weight is, never replicated.

    Args:
        weight: The model variable it belongs to.
        dtype: Its dtype.
        name: Its name.

    Returns:
        A variable of the backend in use.
    """
    return backend.current().state_variable(
        tuple(weight.shape), dtype, name, like=weight
    )


class StateHolder:
    """Lists a model's custom_fit state, for backends whose step is pure.

    On JAX everything a step changes must travel in the step's state; the
    JAX adapter carries these variables beside Keras' own state (not among
    the model's metrics, so `model.metrics` is Keras'). Optimizers that
    update networks of the model through `minimize` are listed too: their
    variables are part of the step's state as well.

    Attributes:
        version: Integer, moved on by every change of the list.
    """

    def __init__(self) -> None:
        self._state: list[Variable] = []
        self._optimizers: list[keras.optimizers.Optimizer] = []
        self.version = 0

    def track(self, variable: Variable) -> None:
        """Adds a state variable."""
        self._state.append(variable)
        self.version += 1

    def track_optimizer(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Adds an optimizer whose variables the step updates."""
        if all(optimizer is not known for known in self._optimizers):
            self._optimizers.append(optimizer)
            self.version += 1

    @property
    def variables(self) -> list[Variable]:
        """The state variables, then those of the tracked optimizers."""
        found = list(self._state)
        for optimizer in self._optimizers:
            found.extend(optimizer.variables)
        return [v for v in found if isinstance(v, keras.Variable)]
