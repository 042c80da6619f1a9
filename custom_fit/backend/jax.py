"""The JAX adapter: the imperative step, run statelessly.

Keras' JAX trainer passes the model's state through a pure step function,
`train_step(state, data) -> (logs, state)`, where `state` holds the values
of the trainable, non-trainable, optimizer and metric variables. custom_fit
keeps one imperative step for every backend, so this adapter builds the
train and test functions itself:

1. The values of `state` are mapped onto their variables in a
   `keras.StatelessScope`: inside it, reading a variable gives its value in
   `state`, and assigning one records the new value.
2. The model's `train_step(data)` (or `test_step`) runs in that scope,
   unchanged: the same code as on TensorFlow.
3. The new values are collected from the scope into the returned state;
   `jax.jit` compiles the whole function.

Gradients come from `jax.value_and_grad` of a pure function of the
differentiated variables' values: it maps them into a child scope (which
also sees every value of the enclosing one), runs the loss function, and
returns the loss and every other update it made (batch-normalization
statistics, metrics), which are then recorded in the enclosing scope.

State that custom_fit makes lazily (the metrics of `report_metric`,
inspection figures, accumulators) must exist before the step is traced,
since the state's structure is fixed then. So the first call of each
function runs the step once eagerly, in a scope whose updates are thrown
away (`discover`): what it creates is made then, outside any trace, and
joins the state. A condition (`run_if`) runs its function and selects,
for every variable it changed, the new or the old value.
"""

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from keras import ops

from custom_fit.backend._dense import add_noise  # noqa: F401
from custom_fit.backend._dense import add_to  # noqa: F401
from custom_fit.backend._dense import all_reduce_sum  # noqa: F401
from custom_fit.backend._dense import batch_gradients  # noqa: F401
from custom_fit.backend._dense import build_batch  # noqa: F401
from custom_fit.backend._dense import check_compile  # noqa: F401
from custom_fit.backend._dense import check_recorded_loss  # noqa: F401
from custom_fit.backend._dense import deduplicate  # noqa: F401
from custom_fit.backend._dense import dense  # noqa: F401
from custom_fit.backend._dense import dense_size  # noqa: F401
from custom_fit.backend._dense import divisible_first_axis  # noqa: F401
from custom_fit.backend._dense import is_sparse  # noqa: F401
from custom_fit.backend._dense import map_values  # noqa: F401
from custom_fit.backend._dense import on_first_replica  # noqa: F401
from custom_fit.backend._dense import recorded_gradients  # noqa: F401
from custom_fit.backend._dense import reducible_logs  # noqa: F401
from custom_fit.backend._dense import replica_count  # noqa: F401
from custom_fit.backend._dense import scaled  # noqa: F401
from custom_fit.backend._dense import squared_sums  # noqa: F401
from custom_fit.backend._dense import summed_count  # noqa: F401
from custom_fit.backend._global_data import fit_callbacks  # noqa: F401
from custom_fit.backend._global_data import forward  # noqa: F401
from custom_fit.backend._global_data import summed_results  # noqa: F401

_LOCAL = threading.local()


class _Scope(keras.StatelessScope):
    """A `keras.StatelessScope` that also remembers the updated variables.

    Args:
        mapping: Dict of `id(variable)` to value: the values the scope
            starts from (copied).
        collect_losses: Bool. Collect the losses of `add_loss`.
    """

    def __init__(self, mapping: dict[int, Any], collect_losses: bool) -> None:
        super().__init__(collect_losses=collect_losses)
        self.state_mapping = dict(mapping)
        self.updated: dict[int, Any] = {}

    def add_update(self, update: tuple[Any, Any]) -> None:
        variable, value = update
        self.updated[id(variable)] = variable
        super().add_update(update)


def _stack() -> list[_Scope]:
    if not hasattr(_LOCAL, "scopes"):
        _LOCAL.scopes = []
    return _LOCAL.scopes


def _current() -> _Scope | None:
    scopes = _stack()
    return scopes[-1] if scopes else None


@contextlib.contextmanager
def _entered(scope: _Scope) -> Iterator[_Scope]:
    """Enters `scope` and makes it the current custom_fit scope."""
    _stack().append(scope)
    try:
        with scope:
            yield scope
    finally:
        _stack().pop()


def _child(overrides: Iterable[tuple[Any, Any]] = ()) -> _Scope:
    """Returns a scope starting from the current one's values."""
    parent = _current()
    mapping = dict(parent.state_mapping) if parent is not None else {}
    for variable, value in overrides:
        mapping[id(variable)] = value
    return _Scope(mapping, collect_losses=True)


def _write_back(scope: _Scope, skip: frozenset[int] = frozenset()) -> None:
    """Records the updates of a finished child scope in its parent.

    Outside any custom_fit scope (a call outside `fit`), the variables are
    assigned directly.
    """
    parent = _current()
    for key, variable in scope.updated.items():
        if key in skip:
            continue
        value = scope.state_mapping[key]
        if parent is not None:
            parent.add_update((variable, value))
        else:
            variable.assign(value)


# Differentiation.


def value_and_grad(
    function: Callable[[], tuple[Any, Any]], variables: Any
) -> tuple[Any, Any, list[Any]]:
    """Returns `(value, aux, gradients)` of `function` w.r.t. `variables`.

    See `custom_fit.backend.tensorflow.value_and_grad`. Updates that
    `function` makes to other variables are kept.
    """
    if callable(variables):
        variables = variables()
    variables = list(variables)
    scopes: list[_Scope] = []

    def pure(values: list[Any]) -> tuple[Any, tuple[Any, dict]]:
        scope = _child(zip(variables, values))
        with _entered(scope):
            value, aux = function()
        scopes.append(scope)
        updates = {key: scope.state_mapping[key] for key in scope.updated}
        return value, (aux, updates)

    start = [variable.value for variable in variables]
    (value, (aux, updates)), gradients = jax.value_and_grad(pure, has_aux=True)(
        start
    )
    scope = scopes[-1]
    scope.state_mapping.update(updates)
    _write_back(scope, skip=frozenset(id(v) for v in variables))
    return value, aux, list(gradients)


def values_and_grads(
    function: Callable[[], tuple[dict[str, Any], Any]], variables: Any
) -> tuple[dict[str, Any], Any, dict[str, list[Any]]]:
    """Returns the values, aux and gradients of several scalar losses.

    See `custom_fit.backend.tensorflow.values_and_grads`: one `jax.vjp` of
    the losses, then one backward pass (a call of its VJP) per loss.
    """
    if callable(variables):
        variables = variables()
    variables = list(variables)
    scopes: list[_Scope] = []

    def pure(values: list[Any]) -> tuple[dict[str, Any], tuple[Any, dict]]:
        scope = _child(zip(variables, values))
        with _entered(scope):
            losses, aux = function()
        scopes.append(scope)
        updates = {key: scope.state_mapping[key] for key in scope.updated}
        return dict(losses), (aux, updates)

    start = [variable.value for variable in variables]
    losses, vjp, (aux, updates) = jax.vjp(pure, start, has_aux=True)
    gradients = {}
    for name in losses:
        cotangent = {
            key: (
                ops.ones_like(value) if key == name else ops.zeros_like(value)
            )
            for key, value in losses.items()
        }
        (gradients[name],) = vjp(cotangent)
        gradients[name] = list(gradients[name])
    scope = scopes[-1]
    scope.state_mapping.update(updates)
    _write_back(scope, skip=frozenset(id(v) for v in variables))
    return losses, aux, gradients


def per_example_gradients(
    function: Callable[..., Any], variables: Sequence[Any], inputs: tuple
) -> tuple[list[Any], bool]:
    """Returns the gradient of `function` for each slice of `inputs`.

    See `custom_fit.backend.tensorflow.per_example_gradients`: here
    `jax.vmap` of `jax.grad`. Updates the function makes (random seeds)
    stay inside it: each slice sees the step's state.
    """
    variables = list(variables)

    def pure(values: list[Any], args: tuple) -> Any:
        scope = _child(zip(variables, values))
        with _entered(scope):
            return function(*args)

    start = [variable.value for variable in variables]
    gradients = jax.vmap(jax.grad(pure), in_axes=(None, 0))(start, inputs)
    return list(gradients), True


def input_gradients(
    function: Callable[[Any], Any], inputs: Sequence[Any]
) -> list[Any]:
    """Returns the gradients of `function(inputs)` w.r.t. `inputs`.

    See `custom_fit.backend.tensorflow.input_gradients`.
    """
    scopes: list[_Scope] = []

    def pure(values: list[Any]) -> tuple[Any, dict]:
        scope = _child()
        with _entered(scope):
            value = function(values)
        scopes.append(scope)
        return value, {key: scope.state_mapping[key] for key in scope.updated}

    gradients, updates = jax.grad(pure, has_aux=True)(
        [ops.convert_to_tensor(x) for x in inputs]
    )
    scope = scopes[-1]
    scope.state_mapping.update(updates)
    _write_back(scope)
    return list(gradients)


def intermediate_gradients(
    function: Callable[[Callable[[Any], Any]], tuple[Any, Any]],
) -> tuple[Any, Any, list[Any]]:
    """Returns `(value, aux, gradients)` of `function(watch)`.

    See `custom_fit.backend.tensorflow.intermediate_gradients`. JAX
    differentiates with respect to a function's arguments only, so
    `watch` adds a zero "probe" argument to each tensor it is given, and
    the gradients are those with respect to the probes. The probes'
    shapes come from a first, abstract trace of `function`
    (`jax.eval_shape`: no computation, its updates thrown away).
    """
    shapes: list[Any] = []

    def shapes_only() -> Any:
        def watch(tensor: Any) -> Any:
            shapes.append(jax.ShapeDtypeStruct(tensor.shape, tensor.dtype))
            return tensor

        with _entered(_child()):
            value, _ = function(watch)
        return value

    jax.eval_shape(shapes_only)
    scopes: list[_Scope] = []

    def pure(probes: list[Any]) -> tuple[Any, tuple[Any, dict]]:
        remaining = iter(probes)

        def watch(tensor: Any) -> Any:
            return tensor + next(remaining)

        scope = _child()
        with _entered(scope):
            value, aux = function(watch)
        scopes.append(scope)
        updates = {key: scope.state_mapping[key] for key in scope.updated}
        return value, (aux, updates)

    probes = [jax.numpy.zeros(s.shape, s.dtype) for s in shapes]
    (value, (aux, updates)), gradients = jax.value_and_grad(pure, has_aux=True)(
        probes
    )
    scope = scopes[-1]
    scope.state_mapping.update(updates)
    _write_back(scope)
    return value, aux, list(gradients)


# Conditional updates.


def run_if(
    condition: Any,
    function: Callable[..., object],
    args: tuple[Any, ...] = (),
    synchronized: bool = False,
) -> None:
    """Runs `function(*args)`; keeps its updates only where `condition`.

    In a step, `jax.lax.cond`: the function runs (and its updates are
    computed) only when the condition holds, where a selection per updated
    variable would compute them always and then pick (measured on the
    seed MLP: the guard's update, 19 selections, cost 0.1 ms of 0.8 per
    step). The function is traced once beforehand, to learn which
    variables it updates (that pass is dead code to XLA). With a concrete
    condition (outside a step, or a step run eagerly) `function` runs only
    when `condition` is true.
    """
    del synchronized
    parent = _current()
    if parent is None or not isinstance(condition, jax.core.Tracer):
        # Op by op (outside a step, or a step run eagerly): a concrete
        # condition is a Python branch, computed as the rest of the step is.
        if bool(np.asarray(condition)):
            function(*args)
        return
    probe = _child()
    with _entered(probe):
        function(*args)
    variables = list(probe.updated.values())
    if not variables:
        return
    olds = []
    for variable in variables:
        old = parent.get_current_value(variable)
        olds.append(variable.value if old is None else old)

    def run(_: Any) -> list[Any]:
        scope = _child()
        with _entered(scope):
            function(*args)
        return [scope.state_mapping[id(v)] for v in variables]

    news = jax.lax.cond(
        jax.numpy.asarray(condition), run, lambda _: list(olds), None
    )
    for variable, value in zip(variables, news):
        parent.add_update((variable, value))


def apply_gradients(
    optimizer: Any,
    gradients: Sequence[Any],
    variables: Sequence[Any],
    tracked: Sequence[Any],
) -> None:
    """Applies `gradients` with `optimizer.stateless_apply`, as Keras does.

    Keras' JAX trainer applies that way too; the new values are recorded in
    the step's scope. The stateful `apply` of some optimizers
    (`LossScaleOptimizer`) updates variables inside branches of `ops.cond`,
    which a traced JAX step cannot carry out; the stateless form returns
    the new values instead.
    """
    known = {id(t) for t in tracked}
    unknown = [v.path for v in variables if id(v) not in known]
    if unknown:
        raise ValueError(
            "The optimizer was built for other variables than it is asked to "
            f"update. Received: variables {unknown} it does not track. Build "
            "the optimizer with the variables it updates "
            "(`optimizer.build(variables)`), or use a new optimizer."
        )
    by_variable = {id(v): g for v, g in zip(variables, gradients)}
    with warnings.catch_warnings():
        if len(by_variable) < len(tracked):
            # The optimizer tracks variables this update leaves alone (a
            # layer frozen since it was built): their `None` gradients are
            # ours, not a missing gradient of the loss.
            warnings.filterwarnings(
                "ignore", message="Gradients do not exist for variables"
            )
        new_trainables, new_optimizer = optimizer.stateless_apply(
            [v.value for v in optimizer.variables],
            [by_variable.get(id(t)) for t in tracked],
            [t.value for t in tracked],
        )
    for variable, value in zip(tracked, new_trainables):
        if id(variable) in by_variable:
            variable.assign(value)
    for variable, value in zip(optimizer.variables, new_optimizer):
        variable.assign(value)


def assign_variables(variables: Sequence[Any], values: Sequence[Any]) -> None:
    """Assigns `values` to `variables` (recorded in the step's scope)."""
    for variable, value in zip(variables, values):
        variable.assign(value)


def restore_if(
    condition: Any, variables: Sequence[Any], values: Sequence[Any]
) -> None:
    """Writes `values` back into `variables` where `condition` holds."""
    for variable, value in zip(variables, values):
        variable.assign(ops.where(condition, value, variable.value))


# State.


def state_variable(
    shape: Sequence[int],
    dtype: str,
    name: str,
    summed: bool = False,
    like: Any = None,
) -> keras.Variable:
    """Returns a zero-initialized, non-trainable Keras variable.

    See `custom_fit.backend.tensorflow.state_variable`; `summed` has no
    meaning on JAX. With `like`, the variable takes the sharding of that
    model variable's value (under `keras.distribution.ModelParallel`, the
    weight's shards; made in the discovery pass, where values are concrete
    arrays). Made inside the discovery pass, it is initialized when that
    pass ends.
    """
    del summed
    return keras.Variable(
        initializer=keras.initializers.Zeros(),
        shape=shape,
        dtype=dtype,
        trainable=False,
        name=name,
        layout=None if like is None else _mesh_sharding(like.value),
    )


def _mesh_sharding(value: Any) -> Any:
    """Returns the sharding of an array over a mesh of devices, or `None`.

    `None` for an array on one device and for a traced value.
    """
    sharding = getattr(value, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    return None


def creation_scope() -> contextlib.AbstractContextManager:
    """Returns a context that does nothing: see `discover`."""
    return contextlib.nullcontext()


def read(variable: Any) -> Any:
    """Returns the current value of a variable (its value in the step)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def copy(value: Any) -> Any:
    """Returns the current value: JAX arrays are immutable."""
    return ops.convert_to_tensor(value)


# The state of each model's latest call of a train or test function, while
# `fit` runs (Keras writes it into the variables at the end of an epoch).
_LATEST: "weakref.WeakKeyDictionary[Any, _Latest]" = weakref.WeakKeyDictionary()


def host_value(model: Any, variable: Any) -> np.ndarray:
    """Returns a variable's value on the host, during `fit` too.

    While `fit` runs, the latest values are in the state that the train
    function returned last (Keras writes them back into the variables only
    at the end of an epoch); they are read from there.
    """
    return fetch(_latest_value(model, variable))


def snapshot(model: Any, variable: Any) -> Any:
    """Returns the variable's latest array, computed or not yet.

    Not the state's own buffer, which the next call donates to the step:
    for a scalar, the copy the step returned beside its state; else a copy
    (queued, asynchronous).
    """
    latest = _LATEST.get(model)
    found = None if latest is None else latest.scalars.get(id(variable))
    if found is not None:
        return found
    return jax.numpy.copy(_latest_value(model, variable))


def _latest_value(model: Any, variable: Any) -> Any:
    """The variable's value in the model's latest state, else its own."""
    latest = _LATEST.get(model)
    value = None if latest is None else latest.get(variable)
    return variable.value if value is None else value


def fetch(value: Any) -> np.ndarray:
    """Returns an array's value in this process, whole.

    With several processes, an array laid out over devices of other
    processes is read from this process's devices when replicated, and
    else gathered from every process: that read is a collective, which
    every process makes at the same point (as Keras' callbacks run in
    every process).
    """
    if not isinstance(value, jax.Array) or value.is_fully_addressable:
        return np.asarray(value)
    if value.is_fully_replicated:
        return np.asarray(value.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def write_latest(model: Any) -> None:
    """Writes the state of the last call into the variables.

    For when training stops with an exception inside an epoch, before
    Keras writes the state back.
    """
    latest = _LATEST.get(model)
    if latest is not None:
        latest.write()


def after_state_sync(model: Any) -> None:
    """Writes the stashed state back and forgets it, after Keras' sync.

    Keras writes back the state it kept from the call before last when
    training stops with an exception; the stash is newer, so it is
    written last.
    """
    write_latest(model)
    _LATEST.pop(model, None)


# Training functions.


def data_shards() -> tuple[int, int]:
    """Returns `(shares, index)`: how the JAX processes feed `fit`.

    Under a `keras.distribution` each process feeds the rows of the global
    batch that its devices hold (Keras makes the global array with
    `jax.make_array_from_process_local_data`): processes whose devices lie
    at different positions of the mesh's batch axis feed different shares
    (`DataParallel` over every process: one share each), processes at the
    same positions the same rows (a model axis that spans processes). The
    shares are numbered in the order of their batch positions. Without a
    distribution, or in one process, `(1, 0)`.
    """
    distribution = keras.distribution.distribution()
    if jax.process_count() == 1 or distribution is None:
        return 1, 0
    mesh = distribution.device_mesh
    devices = np.asarray(mesh.devices, dtype=object)
    axis = list(mesh.axis_names).index(distribution.batch_dim_name)
    positions: dict[int, set[int]] = {}
    for position in range(devices.shape[axis]):
        for device in np.take(devices, [position], axis=axis).flat:
            positions.setdefault(_process_of(device), set()).add(position)
    shares = sorted({tuple(sorted(p)) for p in positions.values()})
    mine = tuple(sorted(positions.get(jax.process_index(), ())))
    return len(shares), shares.index(mine) if mine in shares else 0


def _process_of(device: Any) -> int:
    """The process of a mesh device: a JAX device, or `"platform:id"`."""
    if hasattr(device, "process_index"):
        return int(device.process_index)
    identifier = int(str(device).rsplit(":", 1)[-1])
    for candidate in jax.devices():
        if candidate.id == identifier:
            return int(candidate.process_index)
    return 0


def gather_from_processes(values: Sequence[int]) -> np.ndarray:
    """Returns every process' `values`, one row each (int32 on the wire)."""
    local = np.asarray(list(values), np.int32)
    if data_shards()[0] == 1:
        return local[None].astype(np.int64)
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(local, tiled=False)
    return np.asarray(gathered).astype(np.int64)


def check_strategy() -> None:
    """Accepts every `keras.distribution` setting."""


class _Layout:
    """The variables of each group of a step's state, and where each is.

    Made once per layout of the state (the groups' variables), not per
    call.
    """

    def __init__(self, groups: list[list[Any]]) -> None:
        self.groups = groups
        self.sizes = [len(g) for g in groups]
        self.index = {
            id(variable): (g, i)
            for g, variables in enumerate(groups)
            for i, variable in enumerate(variables)
        }


class _Latest:
    """The state returned by the last call, readable per variable.

    Keras' state (its groups of variables) and custom_fit's own state (the
    last group) of the model's latest call of a train or test function.
    """

    def __init__(
        self, layout: _Layout, state: tuple, scalars: list[Any]
    ) -> None:
        self.layout = layout
        self.state = state
        own = state[-1]
        scalar_values = iter(scalars)
        # The undonated copies of the scalars of custom_fit's state.
        self.scalars = {
            id(variable): next(scalar_values)
            for variable, value in zip(layout.groups[-1], own)
            if not getattr(value, "shape", ())
        }

    def write(self) -> None:
        """Assigns every variable its value in the state."""
        for variables, values in zip(self.layout.groups, self.state):
            for variable, value in zip(variables, values):
                variable.assign(value)

    def get(self, variable: Any) -> Any:
        where = self.layout.index.get(id(variable))
        if where is None:
            return None
        return self.state[where[0]][where[1]]


class _StepFunction:
    """Keras' JAX train or test function, around the imperative step.

    Called as Keras calls its own: `(state, iterator) -> (logs, state)`,
    running `steps_per_execution` steps. custom_fit's own state (see
    `custom_fit._state.StateHolder`) travels beside Keras' state: each call
    starts from the values the model's latest call returned (or, after
    Keras wrote the state back into the variables, from the variables) and
    keeps the new ones for the next call.
    """

    def __init__(
        self, model: Any, kind: str, own_state: Callable[[], list[Any]]
    ) -> None:
        self.model = model
        self.kind = kind
        self.own_state = own_state
        self.discovered = False
        self.step: Any = None  # compiled at the first call
        self.shardings: tuple[Any, Any] | None = None
        self._layout: _Layout | None = None
        self._own: tuple[int, list[Any]] | None = None

    def groups(self) -> list[list[Any]]:
        """The variables of each element of the state, as Keras orders them."""
        model = self.model
        if self.kind == "train":
            return [
                list(model.trainable_variables),
                list(model.non_trainable_variables),
                list(model.optimizer.variables),
                list(model.metrics_variables),
            ]
        return [
            list(model.trainable_variables),
            list(model.non_trainable_variables),
            list(model.metrics_variables),
        ]

    def own_variables(self) -> list[Any]:
        """custom_fit's state variables of the model and its networks.

        Those Keras' state does not hold already, each once; listed again
        only when the list `own_state` returns changed length (state is
        only ever added), not at every call.
        """
        variables = self.own_state()
        if self._own is None or self._own[0] != len(variables):
            in_keras_state = {id(v) for group in self.groups() for v in group}
            found: dict[int, Any] = {}
            for variable in variables:
                if id(variable) not in in_keras_state:
                    found.setdefault(id(variable), variable)
            self._own = (len(variables), list(found.values()))
        return self._own[1]

    def _run(self, data: Any) -> Any:
        if self.kind == "train":
            return self.model.train_step(data)
        return self.model.test_step(data)

    def extra_variables(self) -> list[Any]:
        """Variables the step reads that Keras does not put in its state.

        Keras' test state has no optimizer variables, yet a scheduled
        option is evaluated at `optimizer.iterations` in the test step too;
        their current values are passed beside the state, read-only.
        """
        optimizer = getattr(self.model, "optimizer", None)
        if self.kind == "test" and optimizer is not None:
            return list(optimizer.variables)
        return []

    def _stateless(
        self, state: tuple, own: list[Any], data: Any, extras: list[Any]
    ) -> tuple[Any, tuple, list[Any], list[Any]]:
        groups = self.groups()
        own_variables = self.own_variables()
        mapping = {
            id(variable): value
            for variable, value in zip(self.extra_variables(), extras)
        }
        mapping.update(
            {
                id(variable): value
                for variables, values in zip(
                    [*groups, own_variables], [*state, own]
                )
                for variable, value in zip(variables, values)
            }
        )
        with _entered(_Scope(mapping, collect_losses=True)) as scope:
            logs = self._run(data)
        if self.eager():
            # Run op by op, the step may make its state at its first run:
            # a variable made in the scope was initialized when it closed.
            groups, own_variables = self.groups(), self.own_variables()
            for variable in [*(v for g in groups for v in g), *own_variables]:
                if id(variable) not in scope.state_mapping:
                    scope.state_mapping[id(variable)] = variable.value
        after = [len(g) for g in [*self.groups(), self.own_variables()]]
        if after != [len(g) for g in [*groups, own_variables]]:
            raise RuntimeError(
                "custom_fit made new state while a JAX step was traced: "
                "everything a step reports or keeps must exist when it is "
                "traced. Received: a report or state first made at a "
                f"later trace of the {self.kind} step of "
                f"{self.model.name!r}. Report the same names at every "
                "step (no Python branch on the data)."
            )
        new_state = tuple(
            [scope.state_mapping[id(variable)] for variable in variables]
            for variables in groups
        )
        new_own = [scope.state_mapping[id(v)] for v in own_variables]
        # The scalars of custom_fit's state once more, in buffers the next
        # call does not take over (it donates the state): the host reads
        # them a call later (`snapshot`) without a copy of its own.
        scalars = [
            ops.copy(value)
            for value in new_own
            if not getattr(value, "shape", ())
        ]
        return logs, new_state, new_own, scalars

    def discover(self, state: tuple, data: Any) -> tuple:
        """Traces the step once abstractly, to make the state it makes.

        The step makes some of its state when first run (the metrics of
        `report_metric`, inspection's figures, accumulation's sums, an
        optimizer built at its first update): it is traced once with
        `jax.eval_shape` (shapes only: no op runs, nothing is compiled), in
        a scope of the current values. Variables made there are
        initialized when the scope closes, outside the trace, with their
        initializers' concrete values; the updates the trace computed are
        dropped.

        Returns:
            The state, extended by the state the step made.
        """
        before = self.groups()
        values = {
            id(variable): value
            for variables, group in zip(before, state)
            for variable, value in zip(variables, group)
        }
        for variable in [*self.extra_variables(), *self.own_variables()]:
            values.setdefault(id(variable), variable.value)
        with _entered(_Scope(values, collect_losses=True)):
            jax.eval_shape(self._run, data)
        self.discovered = True
        return tuple(
            [values.get(id(v), None) if id(v) in values else v.value for v in g]
            for g in self.groups()
        )

    def eager(self) -> bool:
        """Whether the step runs op by op (`run_eagerly`, no `jit_compile`)."""
        return bool(self.model.run_eagerly or not self.model.jit_compile)

    def _compiled(self, state: tuple, own: list[Any]) -> Any:
        """Returns the step function, `jax.jit`-compiled unless eager.

        The state leaves each step laid out as it entered the first one
        (`out_shardings`, as Keras' JAX trainer compiles its step): under
        `keras.distribution` nothing is re-laid out by XLA's choice, and
        the step compiles once.
        """
        if self.eager():
            return self._stateless
        self.shardings = _state_shardings(self.groups(), state, own)
        if self.shardings is None:
            return jax.jit(self._stateless, donate_argnums=(0, 1))
        return jax.jit(
            self._stateless,
            donate_argnums=(0, 1),
            out_shardings=(None, *self.shardings, None),
        )

    def own_values(self, own_variables: list[Any]) -> list[Any]:
        """The current values of custom_fit's state, for the next call."""
        latest = _LATEST.get(self.model)
        values = []
        for variable in own_variables:
            value = latest.get(variable) if latest is not None else None
            values.append(variable.value if value is None else value)
        return values

    def __call__(self, state: tuple, iterator: Any) -> tuple[Any, tuple]:
        iterator = iter(iterator)
        data = next(iterator)
        if not self.discovered and not self.eager():
            # Op by op, the first step makes its state itself (`_stateless`):
            # an abstract trace would show a user's hooks tracers.
            state = self.discover(state, data)
        extras = [variable.value for variable in self.extra_variables()]
        own_variables = self.own_variables()
        own = self.own_values(own_variables)
        if self.step is None:
            self.step = self._compiled(state, own)
            if self.shardings is not None:
                # As the step will return it, so that it compiles once.
                state, own = jax.device_put((state, own), self.shardings)
        logs, state, own, scalars = self.step(state, own, data, extras)
        for _ in range(self.model.steps_per_execution - 1):
            try:
                data = next(iterator)
            except StopIteration:
                break
            logs, state, own, scalars = self.step(state, own, data, extras)
        layout = self._layout
        sizes = [*(len(g) for g in state), len(own)]
        if layout is None or layout.sizes != sizes:
            layout = self._layout = _Layout(
                [*self.groups(), self.own_variables()]
            )
        _LATEST[self.model] = _Latest(layout, (*state, own), scalars)
        return logs, state


def _state_shardings(
    groups: list[list[Any]], state: tuple, own: list[Any]
) -> tuple[Any, Any] | None:
    """Returns the shardings a step's state keeps, when it spans devices.

    `None` when no array is laid out over a mesh of devices (no
    distribution). Otherwise each array keeps its mesh sharding, and an
    array on one device (an optimizer or custom_fit state made outside the
    distribution's scope) is replicated over the mesh, as XLA would place
    it. Model weights on one device beside a mesh cannot be right (they
    were made outside the distribution and would be silently replicated):
    refused.

    Raises:
        ValueError: For model weights on one device beside a mesh.
    """
    values = [*(v for values in state for v in values), *own]
    meshes = [
        value.sharding.mesh
        for value in values
        if isinstance(getattr(value, "sharding", None), NamedSharding)
    ]
    if not meshes:
        return None
    weights = [*zip(groups[0], state[0]), *zip(groups[1], state[1])]
    outside = [
        variable.path
        for variable, value in weights
        if not isinstance(getattr(value, "sharding", None), NamedSharding)
    ]
    if outside:
        raise ValueError(
            "Some of the model's weights lie on one device while the rest of "
            "its state is laid out over a `keras.distribution` mesh: they "
            "were made outside the distribution, and one compiled step "
            f"cannot shard them. Received: {outside[:3]} on one device. "
            "Build the model under the distribution: inside "
            "`distribution.scope()` or after "
            "`keras.distribution.set_distribution(...)`."
        )
    replicated = NamedSharding(meshes[0], PartitionSpec())

    def kept(value: Any) -> Any:
        sharding = getattr(value, "sharding", None)
        return sharding if isinstance(sharding, NamedSharding) else replicated

    return (
        tuple([kept(value) for value in values] for values in state),
        [kept(value) for value in own],
    )


class TrainerHooks:
    """Keras trainer methods overridden for custom_fit's JAX state."""

    def jax_state_sync(self) -> None:
        """Writes the state of a JAX `fit` back into the variables, as Keras.

        Called by Keras' JAX trainer (at the end of an epoch, or when a
        callback needs the weights); custom_fit's own state is written too,
        and the next call reads it from the variables again.
        """
        super().jax_state_sync()  # type: ignore[misc]
        after_state_sync(self)


def make_step_function(
    model: Any,
    kind: str,
    build_keras_function: Callable[[], Any],
    own_state: Callable[[], list[Any]],
) -> Any:
    """Returns the train (`kind="train"`) or test function of `model`.

    Args:
        model: The custom_fit model.
        kind: `"train"` or `"test"`.
        build_keras_function: Unused: Keras' JAX functions run Keras' own
            stateless step, which the imperative step replaces.

    Returns:
        A callable `(state, iterator) -> (logs, state)`.
    """
    del build_keras_function
    return _StepFunction(model, kind, own_state)
