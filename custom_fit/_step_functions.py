"""The train and test functions of a custom_fit model.

The backend adapter builds them (Keras' own on TensorFlow and PyTorch,
whose steps are stateful; custom_fit's stateless one on JAX), and they are
wrapped here:

- the model whose function runs marks itself, and every custom_fit model
  nested in it, as the driver of the step: networks that report metrics
  while it runs (and traces) prefix them with their names (see
  `TrainStepMixin.report_metric`);
- the train function checks the consecutive-skip limit of the guards of
  the model and its networks on the host, between calls. Keras' loop
  already waits for each call's result, so the read adds no
  synchronisation; XLA would drop an in-graph assertion.
"""

from collections.abc import Callable
from typing import Any

from custom_fit import _model_state
from custom_fit import backend
from custom_fit._types import StepFunction


def make(
    model: Any, kind: str, keras_function: Callable[[], StepFunction]
) -> StepFunction:
    """Returns the `"train"` or `"test"` function of `model`.

    Args:
        model: The custom_fit model.
        kind: `"train"` or `"test"`.
        keras_function: Callable building Keras' own function of that kind.

    Returns:
        The function Keras' loop calls.
    """
    function = backend.current().make_step_function(model, kind, keras_function)
    if kind == "train":
        function = _with_skipped_step_limit(model, function)
    return _driven(model, function, kind)


def _driven(model: Any, function: StepFunction, kind: str) -> StepFunction:
    """Wraps `function` to mark `model` as the driver while it runs."""
    models = _model_state.models_in(model)

    def driven_step_function(*args: Any) -> Any:
        states = [_model_state.state_of(m) for m in models]
        previous = [state.metrics.driver for state in states]
        for state in states:
            state.metrics.driver = (model, kind)
            state.generation += 1
        try:
            return function(*args)
        finally:
            for state, driver in zip(states, previous):
                state.metrics.driver = driver

    return driven_step_function


def _with_skipped_step_limit(
    model: Any, function: StepFunction
) -> StepFunction:
    """Wraps a train function to raise once too many steps were skipped."""
    guarded = [
        each
        for each in _model_state.models_in(model)
        if each.skip_nonfinite and each.max_consecutive_skipped_steps
    ]
    if not guarded:
        return function

    def checked_train_function(*args: Any) -> Any:
        logs = function(*args)
        for each in guarded:
            guard = _model_state.state_of(each).guard
            guard.check_limit(model, nested=each is not model)
        return logs

    return checked_train_function
