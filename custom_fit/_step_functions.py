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
    function = backend.current().make_step_function(
        model, kind, keras_function, _OwnState(model)
    )
    if kind == "train":
        function = _with_skipped_step_limit(model, function)
    driven = _driven(model, function, kind)
    for name in ("check_pending", "forget_pending"):
        if hasattr(function, name):
            setattr(driven, name, getattr(function, name))
    return driven


class _OwnState:
    """custom_fit's state variables of a model and its networks.

    Called at every call of a pure step's function: the holders are found
    once (at the first call, when the model is built), and their list made
    again only when one changed.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._holders: list[Any] | None = None
        self._listed: tuple[tuple[int, ...], list[Any]] | None = None

    def __call__(self) -> list[Any]:
        if self._holders is None:
            self._holders = [
                _model_state.state_of(each).holder
                for each in _model_state.models_in(self._model)
            ]
        versions = tuple(holder.version for holder in self._holders)
        if self._listed is None or self._listed[0] != versions:
            self._listed = (
                versions,
                [v for holder in self._holders for v in holder.variables],
            )
        return self._listed[1]


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
    """Wraps a train function to raise once too many steps were skipped.

    The streak counters a call leaves are read after the next call (the
    host does not wait for the call it just started) and when `fit` ends
    (`check_last_call`): training stops with the limit's error one call of
    the train function later at most.
    """
    guarded = [
        each
        for each in _model_state.models_in(model)
        if each.skip_nonfinite and each.max_consecutive_skipped_steps
    ]
    if not guarded:
        return function
    pending: list[tuple[Any, Any]] = []

    def check(snapshots: list[tuple[Any, Any]]) -> None:
        for each, value in snapshots:
            guard = _model_state.state_of(each).guard
            guard.check_limit(model, nested=each is not model, value=value)

    def checked_train_function(*args: Any) -> Any:
        logs = function(*args)
        earlier = list(pending)
        pending[:] = [
            (each, _model_state.state_of(each).guard.snapshot(model))
            for each in guarded
        ]
        check(earlier)
        return logs

    def check_pending() -> None:
        snapshots = list(pending)
        pending.clear()
        check(snapshots)

    checked_train_function.check_pending = check_pending  # type: ignore[attr-defined]
    checked_train_function.forget_pending = pending.clear  # type: ignore[attr-defined]
    return checked_train_function


def check_last_call(model: Any) -> None:
    """Checks the streak counters the last call of `fit` left.

    Raises:
        RuntimeError: When the consecutive-skip limit was passed.
    """
    check_pending = getattr(
        getattr(model, "train_function", None), "check_pending", None
    )
    if check_pending is not None:
        check_pending()


def forget_last_call(model: Any) -> None:
    """Forgets what an earlier `fit` left unchecked (it stopped early)."""
    forget = getattr(
        getattr(model, "train_function", None), "forget_pending", None
    )
    if forget is not None:
        forget()
