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
function traces the step once abstractly (`jax.eval_shape`, `discover`):
what it creates is made then, outside the compiled trace, and joins the
state. That trace leaves the backward passes out (gradients of zeros):
they make no state (on a small GPT-2, a quarter of that trace's time).
A condition (`run_if`) is a `jax.lax.cond` over the variables its
function updates.

None of this machinery but the `jax.*` calls is JAX's own: the scopes,
the pure runs and the train function live in `_stateless`, which this
adapter subclasses with JAX's abstract trace, compiler and placement.
"""

import contextlib
import math
import secrets
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from keras import ops

from custom_fit.backend import _stateless
from custom_fit.backend import _writers
from custom_fit.backend._dense import add_noise as _add_noise_each
from custom_fit.backend._dense import add_to  # noqa: F401
from custom_fit.backend._dense import all_reduce_sum  # noqa: F401
from custom_fit.backend._dense import batch_gradients  # noqa: F401
from custom_fit.backend._dense import build_batch  # noqa: F401
from custom_fit.backend._dense import check_compile  # noqa: F401
from custom_fit.backend._dense import check_recorded_loss  # noqa: F401
from custom_fit.backend._dense import check_sampler  # noqa: F401
from custom_fit.backend._dense import deduplicate  # noqa: F401
from custom_fit.backend._dense import dense  # noqa: F401
from custom_fit.backend._dense import dense_size  # noqa: F401
from custom_fit.backend._dense import divisible_first_axis  # noqa: F401
from custom_fit.backend._dense import dtype_groups as _dtype_groups
from custom_fit.backend._dense import group_sums  # noqa: F401
from custom_fit.backend._dense import is_sparse  # noqa: F401
from custom_fit.backend._dense import map_values  # noqa: F401
from custom_fit.backend._dense import model_scope  # noqa: F401
from custom_fit.backend._dense import normal as _normal
from custom_fit.backend._dense import on_first_replica  # noqa: F401
from custom_fit.backend._dense import recorded_gradients  # noqa: F401
from custom_fit.backend._dense import reducible_logs  # noqa: F401
from custom_fit.backend._dense import replica_count  # noqa: F401
from custom_fit.backend._dense import scaled  # noqa: F401
from custom_fit.backend._dense import squared_sums  # noqa: F401
from custom_fit.backend._dense import summed_count  # noqa: F401
from custom_fit.backend._dense import unaliased  # noqa: F401
from custom_fit.backend._global_data import forward  # noqa: F401
from custom_fit.backend._global_data import summed_results  # noqa: F401
from custom_fit.backend._stateless import collected  # noqa: F401
from custom_fit.backend._stateless import read_late  # noqa: F401

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
    run = _stateless.PureRun(variables)

    def pure(values: list[Any]) -> tuple[Any, tuple[Any, dict]]:
        (value, aux), updates = run(values, function)
        return value, (aux, updates)

    start = [variable.value for variable in run.variables]
    if _stateless.discovering():
        # The backward pass makes no state: traced for nothing here.
        value, (aux, updates) = pure(start)
        gradients = [jax.numpy.zeros_like(v) for v in start]
    else:
        (value, (aux, updates)), gradients = jax.value_and_grad(
            pure, has_aux=True
        )(start)
    run.finish(updates, skip_variables=True)
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
    run = _stateless.PureRun(variables)

    def pure(values: list[Any]) -> tuple[dict[str, Any], tuple[Any, dict]]:
        (losses, aux), updates = run(values, function)
        return dict(losses), (aux, updates)

    start = [variable.value for variable in run.variables]
    if _stateless.discovering():
        # The backward passes make no state: traced for nothing here.
        losses, (aux, updates) = pure(start)
        run.finish(updates, skip_variables=True)
        zeros = [jax.numpy.zeros_like(v) for v in start]
        return losses, aux, {name: list(zeros) for name in losses}
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
    run.finish(updates, skip_variables=True)
    return losses, aux, gradients


def per_example_gradients(
    function: Callable[..., Any], variables: Sequence[Any], inputs: tuple
) -> tuple[list[Any], bool]:
    """Returns the gradient of `function` for each slice of `inputs`.

    See `custom_fit.backend.tensorflow.per_example_gradients`: here
    `jax.vmap` of `jax.grad`. Updates the function makes (random seeds)
    stay inside it: each slice sees the step's state.
    """
    run = _stateless.PureRun(variables)

    def pure(values: list[Any], args: tuple) -> Any:
        return run(values, function, *args)[0]

    start = [variable.value for variable in run.variables]
    gradients = jax.vmap(jax.grad(pure), in_axes=(None, 0))(start, inputs)
    return list(gradients), True


def input_gradients(
    function: Callable[[Any], Any], inputs: Sequence[Any]
) -> list[Any]:
    """Returns the gradients of `function(inputs)` w.r.t. `inputs`.

    See `custom_fit.backend.tensorflow.input_gradients`.
    """
    run = _stateless.PureRun()

    def pure(values: list[Any]) -> tuple[Any, dict]:
        return run((), function, values)

    gradients, updates = jax.grad(pure, has_aux=True)(
        [ops.convert_to_tensor(x) for x in inputs]
    )
    run.finish(updates, skip_variables=False)
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

        with _stateless.entered(_stateless.child()):
            value, _ = function(watch)
        return value

    jax.eval_shape(shapes_only)
    run = _stateless.PureRun()

    def pure(probes: list[Any]) -> tuple[Any, tuple[Any, dict]]:
        remaining = iter(probes)

        def watch(tensor: Any) -> Any:
            return tensor + next(remaining)

        (value, aux), updates = run((), function, watch)
        return value, (aux, updates)

    probes = [jax.numpy.zeros(s.shape, s.dtype) for s in shapes]
    (value, (aux, updates)), gradients = jax.value_and_grad(pure, has_aux=True)(
        probes
    )
    run.finish(updates, skip_variables=False)
    return value, aux, list(gradients)


# Noise.


def add_noise(tensors: Sequence[Any], stddev: Any, seeds: Any) -> list[Any]:
    """Returns `tensors` plus normal noise of `stddev`: one draw per dtype.

    XLA compiles each draw's generator (threefry) on its own: one draw of
    every entry of a dtype, split, compiles the seed MLP's DP-SGD step in
    0.75 s where a draw per tensor took 1.7 s, and runs no slower. (On
    TensorFlow with XLA the split draw ran slower: a draw per tensor.)
    Under `keras.distribution.ModelParallel` a draw per tensor, which takes
    the tensor's layout: the split draw cannot take every weight's layout,
    and cost a whole model's size more scratch memory per device (8
    devices, two 512 x 4096 kernels laid out by column and by row: 22 MB
    against 6.4). Data parallelism (or none) draws the same numbers in one
    process as over several.
    """
    if isinstance(
        keras.distribution.distribution(), keras.distribution.ModelParallel
    ):
        return _add_noise_each(tensors, stddev, seeds)
    noisy = list(tensors)
    for indices in _dtype_groups(noisy):
        sizes = [math.prod(noisy[i].shape) for i in indices]
        flat = _normal((sum(sizes),), noisy[indices[0]].dtype, seeds)
        flat = flat * ops.cast(stddev, flat.dtype)
        start = 0
        for i, size in zip(indices, sizes):
            piece = ops.reshape(flat[start : start + size], noisy[i].shape)
            noisy[i] = noisy[i] + piece
            start += size
    return noisy


def secret_seeds(seed: int | None) -> Any:
    """Returns a generator seeded with `seed`, or with 64 secret bits.

    The state, two uint32 words `[seed, counter]`, is the draws' threefry
    key as it is: without a seed both words are drawn from the operating
    system, so that the counter starts at a secret place too. Over several
    processes Keras lays a variable out from values that must agree, and
    a collective here would hang a process that builds a model alone (to
    export it): the state is a public placeholder until `agree_on_seeds`
    gives it process 0's secret, before the first step.
    """
    if seed is not None:
        return keras.random.SeedGenerator(seed)
    if jax.process_count() > 1:
        return keras.random.SeedGenerator(0)
    seeds = keras.random.SeedGenerator(secrets.randbits(32))
    seeds.state.assign(_secret_words())
    return seeds


def _secret_words() -> np.ndarray:
    """Two uint32 words from the operating system's entropy."""
    return np.asarray([secrets.randbits(32), secrets.randbits(32)], np.uint32)


def agree_on_seeds(seeds: Any, given: bool) -> None:
    """Gives a secret generator process 0's fresh words, in every process.

    A given seed is the same in every process already.
    """
    if given or jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    words = multihost_utils.broadcast_one_to_all(_secret_words())
    seeds.state.assign(np.asarray(words, np.uint32))


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """Returns `jax.jit(function)`.

    Each eager JAX operation compiles on its first call: the seed MLP's
    two training passes took 1.27 s op by op, 0.21 s jitted.
    """
    return jax.jit(function)


def local_values(variables: Sequence[Any]) -> list[Any]:
    """Returns the variables' values; host copies over several processes.

    A value laid out over several processes' devices cannot meet this
    process' own arrays in an operation: its copy here (a replicated
    value's) goes to the host.
    """
    if jax.process_count() == 1:
        return [variable.value for variable in variables]
    return [np.asarray(variable.value) for variable in variables]


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
    step). The function is traced once, in the branch that runs it: the
    variables it updates there are those the other branch passes through
    unchanged (JAX traces the branch that runs first; were the other
    traced first, it would trace the function for the list, as dead code
    to XLA). With a concrete condition (outside a step, or a step run
    eagerly) `function` runs only when `condition` is true.
    """
    del synchronized
    parent = _stateless.current()
    if parent is None or not isinstance(condition, jax.core.Tracer):
        # Op by op (outside a step, or a step run eagerly): a concrete
        # condition is a Python branch, computed as the rest of the step is.
        if bool(np.asarray(condition)):
            function(*args)
        return
    # The variables the function updates, from whichever branch is traced
    # first.
    updated: list[list[Any]] = []

    def old(variable: Any) -> Any:
        value = parent.get_current_value(variable)
        return variable.value if value is None else value

    def run(_: Any) -> list[Any]:
        scope = _stateless.child()
        with _stateless.entered(scope):
            function(*args)
        if not updated:
            updated.append(list(scope.updated.values()))
        mapping = scope.state_mapping
        return [
            mapping[id(v)] if id(v) in mapping else old(v) for v in updated[0]
        ]

    def keep(_: Any) -> list[Any]:
        if not updated:
            probe = _stateless.child()
            with _stateless.entered(probe):
                function(*args)
            updated.append(list(probe.updated.values()))
        return [old(v) for v in updated[0]]

    news = jax.lax.cond(jax.numpy.asarray(condition), run, keep, None)
    for variable, value in zip(updated[0], news):
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


def host_value(model: Any, variable: Any) -> np.ndarray:
    """Returns a variable's value on the host, during `fit` too.

    While `fit` runs, the latest values are in the state that the train
    function returned last (Keras writes them back into the variables only
    at the end of an epoch); they are read from there.
    """
    return fetch(_stateless.latest_value(model, variable))


def snapshot(model: Any, variable: Any) -> Any:
    """Returns the variable's latest array, computed or not yet.

    Not the state's own buffer, which the next call donates to the step:
    for a scalar, the copy the step returned beside its state; else a copy
    (queued, asynchronous).
    """
    latest = _stateless.LATEST.get(model)
    found = None if latest is None else latest.scalars.get(id(variable))
    if found is not None:
        return found
    return jax.numpy.copy(_stateless.latest_value(model, variable))


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
    _stateless.write_latest(model)


def after_state_sync(model: Any) -> None:
    """Writes the stashed state back and forgets it, after Keras' sync.

    Keras writes back the state it kept from the call before last when
    training stops with an exception; the stash is newer, so it is
    written last.
    """
    write_latest(model)
    _stateless.LATEST.pop(model, None)


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


def _mesh_processes() -> list[int]:
    """The processes whose devices the distribution's mesh holds, sorted.

    One process, or no distribution: `[]` (nothing shared).
    """
    distribution = keras.distribution.distribution()
    if jax.process_count() == 1 or distribution is None:
        return []
    devices = np.asarray(distribution.device_mesh.devices, dtype=object)
    return sorted({_process_of(device) for device in devices.flat})


def writes_files(model: Any) -> bool:
    """Whether this process writes: alone, or the first of its mesh's."""
    del model
    processes = _mesh_processes()
    return len(processes) < 2 or jax.process_index() == processes[0]


def fit_callbacks(model: Any, callbacks: list[Any], x: Any) -> list[Any]:
    """Returns the callbacks `fit` runs.

    Over several processes of one `keras.distribution` mesh, the writing
    callbacks run in every process (Keras' state sync before a save or a
    read of the model checks that the processes agree: each must join), the
    first writing the user's files and the others into a scratch directory;
    `BackupAndRestore` restores in every process (`_writers`).
    """
    del x
    if len(_mesh_processes()) < 2:
        return callbacks

    def barrier() -> None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("custom_fit: backup restored")

    return _writers.written_once(
        callbacks,
        first=writes_files(model),
        barrier=barrier,
        everywhere=True,
    )


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


class _StepFunction(_stateless.StepFunction):
    """Keras' JAX train or test function, around the imperative step.

    `_stateless.StepFunction` with JAX's transformations: the abstract
    trace is `jax.eval_shape`, the compiler `jax.jit` (the state donated,
    and laid out as it entered the first step), the placement
    `jax.device_put`.
    """

    def __init__(
        self, model: Any, kind: str, own_state: Callable[[], list[Any]]
    ) -> None:
        super().__init__(model, kind, own_state)
        self.shardings: tuple[Any, Any] | None = None

    def _abstract(self, function: Callable[..., Any], *args: Any) -> Any:
        return jax.eval_shape(function, *args)

    def __call__(self, state: tuple, iterator: Any) -> tuple[Any, tuple]:
        with _escaped_tracers_named():
            return super().__call__(state, iterator)

    def _compile(self, state: tuple, own: list[Any]) -> Any:
        """Returns the step `jax.jit`-compiled.

        The state leaves each step laid out as it entered the first one
        (`out_shardings`, as Keras' JAX trainer compiles its step): under
        `keras.distribution` nothing is re-laid out by XLA's choice, and
        the step compiles once.
        """
        self.shardings = _state_shardings(self.groups(), state, own)
        if self.shardings is None:
            return jax.jit(self._stateless, donate_argnums=(0, 1))
        return jax.jit(
            self._stateless,
            donate_argnums=(0, 1),
            out_shardings=(None, *self.shardings, None),
        )

    def _placed(self, state: tuple, own: list[Any]) -> tuple[tuple, list]:
        if self.shardings is None:
            return state, own
        return jax.device_put((state, own), self.shardings)


@contextlib.contextmanager
def _escaped_tracers_named() -> Iterator[None]:
    """Names the fix of a value that escaped a differentiated function.

    Only for a tracer of differentiation (JAX names its type): another
    escaped tracer (of a `jax.jit` or `lax.scan` of the user's) keeps
    JAX's message alone.
    """
    try:
        yield
    except jax.errors.UnexpectedTracerError as error:
        if not any(k in str(error) for k in ("JVPTracer", "LinearizeTracer")):
            raise
        raise jax.errors.UnexpectedTracerError(
            "The step used a value computed inside a function that JAX "
            "differentiates (a loss function given to `minimize`) after "
            "that function returned. If it left through a variable of an "
            "enclosing scope, return it with the loss instead: the loss "
            "function returns `(loss, aux)` and `applied, aux = "
            "model.minimize(loss_function, has_aux=True)`. JAX's message: "
            f"{error}"
        ) from error


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

    def state_sync(self) -> None:
        """`jax_state_sync` under its name from Keras 3.16, which calls it.

        (Keras 3.16's `jax_state_sync` calls `state_sync`: the stash is
        then written by the first of the two, and forgotten.)
        """
        super().state_sync()  # type: ignore[misc]
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
