"""custom_fit's plain state of one model, kept out of Keras' tracking.

Keras tracks every attribute set on a model (layers, variables, metrics)
and refuses new tracked state once a subclassed model is built. What the
mixins keep beside the options (reported metrics, the guard's counter,
accumulators, inspection figures, warnings given) lives in one
`ModelState` object, stored once in the model's `__dict__`.
"""

import threading
from collections.abc import Callable
from typing import Any

from custom_fit import _state
from custom_fit import _step_metrics


class ModelState:
    """The mixins' state of one model.

    Attributes:
        options: Dict of option name to its validated value.
        declared: Dict of declared state name to its variable (a
            generator for `Seeds`, a `VariableSlots` for `Slots`).
        metrics: The `report_metric` registry (`_step_metrics.StepMetrics`).
        guard: The guard of `skip_nonfinite` (`_guard.Guard`), made when
            the options are configured.
        holder: The `_state.StateHolder` listing the model's state
            variables and the optimizers its networks are updated with.
        accumulators: Dict of variable-set key to `GradientAccumulator`.
        warned: Set of keys of the warnings already given.
        generation: Integer, moved on by every call of a step function
            that runs this model, so that per-step marks of a trace can be
            told from those of an earlier one.
        local: Per-thread flags of the step being traced (MirroredStrategy
            traces each replica in a thread of its own).
        records: Dict of a mixin's key to what it keeps on the host
            (`record_of`).
        seeded: Dict of a declared `Seeds`' name to the seed its
            generator was made with.
    """

    def __init__(self) -> None:
        self.options: dict[str, Any] = {}
        # The variables of the mixins' declared `State`s, by name.
        self.declared: dict[str, Any] = {}
        self.metrics = _step_metrics.StepMetrics()
        self.guard: Any = None
        self.holder = _state.StateHolder()
        self.accumulators: dict[tuple[int, ...], Any] = {}
        self.warned: set[str] = set()
        self.generation = 0
        self.local = threading.local()
        # What a mixin keeps on the host beside its declared state, by
        # the mixin's key (`record_of`).
        self.records: dict[str, Any] = {}
        # The seed each declared `Seeds` generator was made with.
        self.seeded: dict[str, Any] = {}


def state_of(model: Any) -> ModelState:
    """Returns the `ModelState` of `model`, made on first use.

    Args:
        model: A custom_fit model.

    Returns:
        Its `ModelState`.
    """
    state = model.__dict__.get("_custom_fit")
    if state is None:
        state = model.__dict__["_custom_fit"] = ModelState()
    return state


def record_of(model: Any, key: str, make: Callable[[], Any]) -> Any:
    """Returns what a mixin keeps on the host for `model`, made once.

    For bookkeeping outside the step (how a fit draws its batches, what a
    check found); what the step reads and writes is declared state
    (`options.State`, `options.Seeds`).

    Args:
        model: A custom_fit model.
        key: The mixin's key (its class name).
        make: Makes the record (a dataclass) on first use.
    """
    records = state_of(model).records
    if key not in records:
        records[key] = make()
    return records[key]


def models_in(model: Any) -> list[Any]:
    """Returns `model` and the custom_fit models nested in it, depth first.

    A custom_fit model is one with a `ModelState` (made when its options
    are configured).
    """
    found = [model]
    pending = list(getattr(model, "layers", []))
    while pending:
        layer = pending.pop(0)
        if "_custom_fit" in vars(layer):
            found.append(layer)
        pending.extend(getattr(layer, "layers", []))
    return found
