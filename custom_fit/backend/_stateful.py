"""Shared parts of the adapters of stateful backends (TensorFlow, PyTorch).

Their step updates the variables in place (inside `tf.function`, or
eagerly), as Keras' own trainers of these backends do: Keras' train and
test functions run custom_fit's step unchanged, and the variables always
hold the latest values. See `_contract.Adapter` for each name.
"""

import threading
from collections.abc import Callable
from typing import Any

_LOCAL = threading.local()


def make_step_function(
    model: Any,
    kind: str,
    build_keras_function: Callable[[], Any],
    own_state: Callable[[], list[Any]],
) -> Any:
    """Returns Keras' own train or test function: the step is stateful."""
    del model, kind, own_state
    return build_keras_function()


def write_latest(model: Any) -> None:
    """Does nothing: the variables always hold the latest values."""
    del model


def after_state_sync(model: Any) -> None:
    """Does nothing: the step is stateful, Keras syncs no state."""
    del model


def collected() -> list[Any]:
    """Returns this thread's list of collected items (the step is one run)."""
    if not hasattr(_LOCAL, "collected"):
        _LOCAL.collected = []
    return _LOCAL.collected


def read_late(variable: Any) -> None:
    """Does nothing: the variables always hold the latest values."""
    del variable
