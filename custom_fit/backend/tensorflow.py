"""The TensorFlow adapter: tapes, `tf.distribute`, `tf.IndexedSlices`.

The step runs statefully inside Keras' own `tf.function` train function:
variables are read and written in place. Under a `tf.distribute`
strategy, each replica runs the step on its share of the batch; gradients
are summed across replicas here, and updates that synchronise replicas
(the optimizer's `apply`, writes to mirrored variables) run in the
cross-replica context when they are conditional.
"""

import contextlib
import secrets
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from custom_fit.backend import _dense
from custom_fit.backend import _writers
from custom_fit.backend._global_data import data_shards  # noqa: F401
from custom_fit.backend._global_data import forward  # noqa: F401
from custom_fit.backend._global_data import gather_from_processes  # noqa: F401
from custom_fit.backend._global_data import summed_results  # noqa: F401
from custom_fit.backend._stateful import after_state_sync  # noqa: F401
from custom_fit.backend._stateful import collected  # noqa: F401
from custom_fit.backend._stateful import make_step_function  # noqa: F401
from custom_fit.backend._stateful import read_late  # noqa: F401
from custom_fit.backend._stateful import write_latest  # noqa: F401

# Differentiation.


def value_and_grad(
    function: Callable[[], tuple[Any, Any]], variables: Any
) -> tuple[Any, Any, list[Any]]:
    """Returns `(value, aux, gradients)` of `function` w.r.t. `variables`.

    Args:
        function: Callable of no arguments returning `(value, aux)`, `value`
            a scalar tensor; it reads the variables.
        variables: List of variables to differentiate, or a callable of no
            arguments returning it, called after `function` (which may
            build the model).

    Returns:
        The value, the aux output, and a list of gradients aligned with
        `variables` (tensors, `tf.IndexedSlices` or `None`).
    """
    with tf.GradientTape() as tape:
        value, aux = function()
    if callable(variables):
        variables = variables()
    return value, aux, tape.gradient(value, list(variables))


def values_and_grads(
    function: Callable[[], tuple[dict[str, Any], Any]], variables: Any
) -> tuple[dict[str, Any], Any, dict[str, list[Any]]]:
    """Returns the values, aux and gradients of several scalar losses.

    One forward pass (`function`, under a persistent tape) and one backward
    pass per loss.

    Args:
        function: Callable of no arguments returning `(values, aux)`,
            `values` a dict of name to scalar tensor.
        variables: List of variables to differentiate, or a callable
            returning it (called after `function`).

    Returns:
        The values, the aux output, and a dict of name to the list of
        gradients of that value, aligned with `variables`.
    """
    with tf.GradientTape(persistent=True) as tape:
        values, aux = function()
    if callable(variables):
        variables = variables()
    variables = list(variables)
    gradients = {
        name: tape.gradient(v, variables) for name, v in values.items()
    }
    del tape
    return values, aux, gradients


def _normal(shape: Sequence[int], dtype: str, seeds: Any) -> Any:
    """Returns standard normal draws of `shape`, seeded from `seeds`.

    Draws with the Philox algorithm, named: for a stateless draw under XLA
    on CPU, TensorFlow's automatic choice (which Keras' `random.normal`
    takes) measured 24 ms for 50,000 numbers here, Philox 1 ms.

    Args:
        shape: The shape of the draw.
        dtype: A floating-point dtype.
        seeds: A `keras.random.SeedGenerator`; advanced by one draw.

    Returns:
        A tensor.
    """
    seed = tf.cast(seeds.next(), "int64")
    return tf.random.stateless_normal(
        shape, seed=seed, dtype=dtype, alg="philox"
    )


def add_noise(tensors: Sequence[Any], stddev: Any, seeds: Any) -> list[Any]:
    """Returns `tensors` plus noise: one Philox draw (`_normal`) each."""
    return _dense.noisy(tensors, stddev, seeds, _normal)


def secret_seeds(seed: int | None) -> Any:
    """Returns a generator seeded with `seed`, or with 62 secret bits.

    The state is two int64 words, `[seed, counter]`, which Philox reads
    whole (`_normal`): 62 bits of entropy in the first word leave the
    counter at 0, so that `MultiWorkerMirroredStrategy`, which gives every
    worker the chief's initial value of a variable made in its scope,
    gives every worker the same generator.
    """
    if seed is None:
        seed = secrets.randbits(62)
    return keras.random.SeedGenerator(seed)


def _workers(strategy: Any) -> int:
    """The number of `tf.distribute` workers `strategy` spans."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    return max(1, len(spec.get("worker", ())) + len(spec.get("chief", ())))


def _strategy_of(model: Any) -> Any:
    """The strategy `model` was made under, else the one in scope."""
    strategy = getattr(model, "distribute_strategy", None)
    return strategy if strategy is not None else tf.distribute.get_strategy()


def check_sampler(model: Any, sampler: Any) -> None:
    """Raises for a sampler under `tf.distribute` over several workers.

    The workers are counted from the strategy the model was made under,
    whether or not `fit` runs in its scope.
    """
    workers = max(
        _workers(_strategy_of(model)), _workers(tf.distribute.get_strategy())
    )
    if workers > 1:
        raise ValueError(
            f"A {type(sampler).__name__} cannot be fed over several "
            "tf.distribute workers: each worker reads its own sampler and "
            "the strategy splits the batches, so a step's global batch "
            "would not be one draw (and the workers' secret seeds differ). "
            f"Received: {workers} workers. Train on one worker, or on JAX "
            "or PyTorch processes, where each process feeds its share of "
            "one draw."
        )


def writes_files(model: Any) -> bool:
    """Whether this worker writes: alone, or the chief of several.

    The chief is the worker `tf.distribute` checkpoints from
    (`strategy.extended.should_checkpoint`: the `chief` task, else worker
    0).
    """
    strategy = _strategy_of(model)
    return _workers(strategy) == 1 or bool(strategy.extended.should_checkpoint)


def fit_callbacks(model: Any, callbacks: list[Any], x: Any) -> list[Any]:
    """Returns the callbacks `fit` runs.

    Over several `tf.distribute` workers, the writing callbacks run in
    every worker (saving reads the synchronized variables, an all-reduce
    each worker must join), the chief writing the user's files and the
    others into a scratch directory; `BackupAndRestore` restores in every
    worker (`_writers`).
    """
    del x
    strategy = _strategy_of(model)
    if _workers(strategy) == 1:
        return callbacks

    def barrier() -> None:
        # An all-reduce of one number: returns once every worker joined.
        strategy.reduce(
            "SUM", strategy.run(lambda: tf.constant(1.0)), axis=None
        )

    return _writers.written_once(
        callbacks,
        first=writes_files(model),
        barrier=barrier,
        everywhere=True,
    )


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """Returns `function`: TensorFlow's eager operations start fast."""
    return function


def local_values(variables: Sequence[Any]) -> list[Any]:
    """Returns the variables' values (a worker holds every value)."""
    return [variable.value for variable in variables]


def agree_on_seeds(seeds: Any, given: bool) -> None:
    """Does nothing: `tf.distribute` workers share initial values."""
    del seeds, given


def divisible_first_axis(tensor: Any, count: int, message: str) -> Any:
    """Returns `tensor`, checking that `count` divides its first axis.

    The first axis is known only at run time (a dataset's batch); the step
    fails with `message` if it is no multiple of `count`. The returned
    tensor depends on the check, so that an op using it (the split into
    microbatches) cannot fail first with its own message. Under XLA
    TensorFlow drops the check, and the split's error remains.
    """
    size = tf.shape(tensor)[0]
    check = tf.debugging.assert_equal(size % count, 0, message=message)
    with tf.control_dependencies([check]):
        return tf.identity(tensor)


def per_example_gradients(
    function: Callable[..., Any], variables: Sequence[Any], inputs: tuple
) -> tuple[list[Any], bool]:
    """Returns the gradient of `function` for each slice of `inputs`.

    `tf.vectorized_map` differentiates every slice at once; when an op of
    the model cannot be vectorized (a random op with a seed state, say),
    the slices are differentiated one after another in a `tf.map_fn` loop.

    Args:
        function: Callable taking one slice of each of `inputs` (their
            first axis removed), returning a scalar loss.
        variables: The variables to differentiate.
        inputs: Tuple of nested tensors whose first axis is the slice.

    Returns:
        A tuple `(gradients, vectorized)`: one tensor per variable, whose
        first axis is the slice, and whether `tf.vectorized_map` was used.
    """
    variables = list(variables)

    def one(args: tuple) -> list[Any]:
        with tf.GradientTape() as tape:
            loss = function(*args)
        gradients = tape.gradient(
            loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        return [tf.convert_to_tensor(g) for g in gradients]

    try:
        return (
            tf.vectorized_map(one, inputs, fallback_to_while_loop=False),
            True,
        )
    except Exception:  # noqa: BLE001  (an op pfor cannot vectorize)
        signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
        return tf.map_fn(one, inputs, fn_output_signature=signature), False


def check_recorded_loss(tape: Any) -> None:
    """Raises unless `tape` is a `tf.GradientTape`."""
    if not isinstance(tape, tf.GradientTape):
        raise ValueError(
            "`minimize(loss, tape)` takes the tf.GradientTape that recorded "
            f"the loss. Received: tape={tape!r}. Pass the tape, or a function "
            "of no arguments that computes the loss."
        )


def recorded_gradients(
    tape: tf.GradientTape, value: Any, variables: Sequence[Any]
) -> list[Any]:
    """Returns the gradients of `value` recorded on a caller's `tape`."""
    return tape.gradient(value, list(variables))


def input_gradients(
    function: Callable[[Any], Any], inputs: Sequence[Any]
) -> list[Any]:
    """Returns the gradients of `function(inputs)` w.r.t. tensors `inputs`.

    Taken with a nested tape, so that an outer differentiation sees the
    result as a function of the variables (double backpropagation).
    Inputs the value does not depend on get zero gradients.

    Args:
        function: Callable taking the list `inputs`, returning a scalar.
        inputs: List of floating-point tensors.

    Returns:
        A list of tensors aligned with `inputs`.
    """
    inputs = [tf.convert_to_tensor(x) for x in inputs]
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        value = function(inputs)
    return tape.gradient(
        value, inputs, unconnected_gradients=tf.UnconnectedGradients.ZERO
    )


def intermediate_gradients(
    function: Callable[[Callable[[Any], Any]], tuple[Any, Any]],
) -> tuple[Any, Any, list[Any]]:
    """Returns `(value, aux, gradients)` of `function(watch)`.

    The tape differentiates the value with respect to the tensors that
    `function` passes to `watch` (intermediate results: a tape records
    every op, and `watch` makes sure it records those).

    Args:
        function: Callable taking `watch` (a callable returning the tensor
            it is given) and returning `(value, aux)`, `value` a scalar.

    Returns:
        The value, the aux output, and the list of gradients of the value
        with respect to the watched tensors, in the order watched (zeros
        where the value does not depend on one).
    """
    watched: list[Any] = []
    with tf.GradientTape() as tape:

        def watch(tensor: Any) -> Any:
            tape.watch(tensor)
            watched.append(tensor)
            return tensor

        value, aux = function(watch)
    gradients = tape.gradient(
        value, watched, unconnected_gradients=tf.UnconnectedGradients.ZERO
    )
    return value, aux, list(gradients)


# Replicas.


def replica_count() -> int:
    """Returns the number of replicas whose gradients are summed per step.

    Returns:
        `num_replicas_in_sync` of the current replica context, or 1 outside
        any (cross-replica context).
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        return 1
    return context.num_replicas_in_sync


def all_reduce_sum(gradients: Sequence[Any]) -> list[Any]:
    """Sums gradients across the replicas of the current replica context.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.

    Returns:
        The list of summed gradients, identical on every replica (`None`
        stays `None`); the input unchanged with a single replica.
    """
    if replica_count() == 1:
        return list(gradients)
    present = [g for g in gradients if g is not None]
    if not present:
        return list(gradients)
    summed = iter(
        tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, present
        )
    )
    return [None if g is None else next(summed) for g in gradients]


def batch_gradients(gradients: Sequence[Any]) -> list[Any]:
    """The global batch's gradients from each replica's: their sum.

    Keras divides each replica's loss by the replica count under
    `tf.distribute`, so the sum is the gradient of the global batch's loss.
    """
    return all_reduce_sum(gradients)


def summed_count(count: Any) -> Any:
    """Returns a replica's count of examples times the replica count."""
    return count * replica_count()


def on_first_replica(value: Any) -> Any:
    """Returns `value` on the first replica and 0 on the others.

    A metric that sums its updates across replicas then counts a value
    that is the same on every replica once.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    first = tf.equal(context.replica_id_in_sync_group, 0)
    return value * tf.cast(first, value.dtype)


# Conditional updates.


def run_if(
    condition: Any,
    function: Callable[..., object],
    args: tuple[Any, ...] = (),
    synchronized: bool = False,
) -> None:
    """Runs `function(*args)` only when `condition` is true.

    Outside `tf.distribute`, and for functions that do not synchronise
    replicas, this is a `tf.cond`. The optimizer's `apply` synchronises
    replicas with a `merge_call`, which may not sit in a `tf.cond` branch in
    replica context; with `synchronized=True` the condition (the same on
    every replica) is evaluated in cross-replica context, as
    `LossScaleOptimizer` does, and `function` runs on each replica with
    that replica's `args`.

    Pass every per-replica tensor `function` uses through `args`, not a
    closure: inside the cross-replica branch a closure would hand every
    replica the tensors of the replica that traced it (a wrong update).

    Args:
        condition: Boolean scalar tensor, the same on every replica.
        function: Callable; its return value is dropped.
        args: Tuple of (nested) per-replica tensors passed to `function`.
        synchronized: Bool. Whether `function` synchronises replicas.
    """

    def run() -> tf.Tensor:
        function(*args)
        return tf.constant(True)

    def skip() -> tf.Tensor:
        return tf.constant(False)

    if not synchronized or _outside_replica_context():
        tf.cond(condition, run, skip)
        return

    def cross_replica(
        strategy: tf.distribute.Strategy,
        condition: tf.Tensor,
        args: tuple[Any, ...],
    ) -> None:
        first = strategy.experimental_local_results(condition)[0]

        def run_on_each_replica() -> tf.Tensor:
            strategy.extended.call_for_each_replica(function, args=args)
            return tf.constant(True)

        tf.cond(first, run_on_each_replica, skip)

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(condition, tuple(args))
    )


def apply_gradients(
    optimizer: Any,
    gradients: Sequence[Any],
    variables: Sequence[Any],
    tracked: Sequence[Any],
) -> None:
    """Applies `gradients` to `variables` with `optimizer.apply`."""
    del tracked
    optimizer.apply(gradients, variables)


def assign_variables(variables: Sequence[Any], values: Sequence[Any]) -> None:
    """Assigns `values` to model variables, in replica context too.

    Keras model variables are mirrored under `tf.distribute` and refuse a
    plain `assign` in replica context; the values (the same on every
    replica) are then written through the strategy, as the optimizer does.

    Args:
        variables: List of variables.
        values: List of tensors aligned with `variables`.
    """
    if _outside_replica_context():
        for variable, value in zip(variables, values):
            variable.assign(value)
        return

    def cross_replica(strategy: tf.distribute.Strategy, values: list) -> None:
        for variable, value in zip(variables, values):
            strategy.extended.update(
                getattr(variable, "value", variable),
                lambda target, new: target.assign(new),
                args=(value,),
                group=False,
            )

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(list(values),)
    )


def restore_if(
    condition: Any, variables: Sequence[Any], values: Sequence[Any]
) -> None:
    """Writes `values` back into per-replica `variables` when `condition`.

    For state each replica keeps on its own (metric variables), written
    without synchronisation.
    """
    for variable, value in zip(variables, values):
        variable.assign(tf.where(condition, value, read(variable)))


def _outside_replica_context() -> bool:
    """Returns whether no strategy's replica context is current."""
    return (
        not tf.distribute.has_strategy()
        or tf.distribute.in_cross_replica_context()
    )


# State.


def state_variable(
    shape: Sequence[int],
    dtype: str,
    name: str,
    summed: bool = False,
    like: Any = None,
) -> tf.Variable:
    """Returns a zero-initialized variable for custom_fit's own state.

    A plain `tf.Variable` (cheaper to update than a Keras variable), made
    like Keras' metric state: `ON_READ`, so that each replica writes its
    own copy. A read returns the first replica's copy, or with `summed`
    the sum of all copies (metric totals).

    Args:
        shape: The variable's shape.
        dtype: Its dtype.
        name: Its name.
        summed: Bool. Whether a read sums the replicas' copies.
        like: Optional model variable whose layout the state takes; under
            `tf.distribute` every replica holds whole copies, so unused.

    Returns:
        A `tf.Variable`.
    """
    del like
    aggregation = (
        tf.VariableAggregation.SUM
        if summed
        else tf.VariableAggregation.ONLY_FIRST_REPLICA
    )
    with tf.init_scope():
        return tf.Variable(
            tf.zeros(shape, dtype),
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=aggregation,
            name=name,
        )


def creation_scope() -> contextlib.AbstractContextManager:
    """Returns a context that lifts state made in a traced step out of it.

    State made in it is created once, eagerly (`tf.init_scope`).
    """
    return tf.init_scope()


def model_scope(model: Any) -> contextlib.AbstractContextManager:
    """Returns the scope of the model's strategy (none: the default one)."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None or strategy is tf.distribute.get_strategy():
        return contextlib.nullcontext()  # in force already, or none
    return strategy.scope()


def read(variable: Any) -> Any:
    """Returns the current value of a state or model variable, in a step."""
    if isinstance(variable, tf.Variable):
        return variable.read_value()
    return tf.convert_to_tensor(variable)


def host_value(model: Any, variable: Any) -> np.ndarray:
    """Returns a variable's value on the host, for callbacks and checks."""
    del model
    return np.asarray(variable.numpy())


def snapshot(model: Any, variable: Any) -> Any:
    """Returns the variable's value (a step has run when its call returns)."""
    return host_value(model, variable)


def fetch(value: Any) -> np.ndarray:
    """Returns the value of `snapshot` (already on the host)."""
    return np.asarray(value)


def copy(value: Any) -> Any:
    """Returns a copy of a variable's current value, kept in the step."""
    return tf.identity(tf.convert_to_tensor(value))


# Sparse gradients (`tf.IndexedSlices`, the gradient of an Embedding).


def is_sparse(gradient: Any) -> bool:
    """Returns whether `gradient` is a `tf.IndexedSlices`."""
    return isinstance(gradient, tf.IndexedSlices)


def map_values(function: Callable[[Any], Any], gradient: Any) -> Any:
    """Applies `function` to the values of a `tf.IndexedSlices`."""
    return tf.IndexedSlices(
        function(gradient.values), gradient.indices, gradient.dense_shape
    )


def deduplicate(gradient: Any) -> Any:
    """Sums the rows of a `tf.IndexedSlices` that share an index.

    `tape.gradient` returns one row per lookup, so an index looked up twice
    appears twice. Norms and element-wise clipping must act on the summed
    row (the dense gradient), not on each part.
    """
    unique_indices, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(
        gradient.values, positions, tf.shape(unique_indices)[0]
    )
    return tf.IndexedSlices(values, unique_indices, gradient.dense_shape)


def squared_sums(gradients: Sequence[Any]) -> Any:
    """Returns each gradient's float32 sum of squares, as one vector.

    A `tf.IndexedSlices` (deduplicated by the caller) counts its values.
    """
    return tf.stack(
        [
            tf.reduce_sum(tf.square(tf.cast(_values(g), tf.float32)))
            for g in gradients
        ]
    )


def group_sums(values: Any, segments: Any, count: int) -> Any:
    """Returns the sum of `values` in each of `count` groups."""
    return tf.math.unsorted_segment_sum(values, segments, count)


def scaled(gradients: Sequence[Any], factor: Any) -> list[Any]:
    """Returns each gradient times `factor`; sparse ones keep indices."""
    return [
        map_values(lambda v: v * tf.cast(factor, v.dtype), g)
        if isinstance(g, tf.IndexedSlices)
        else g * tf.cast(factor, g.dtype)
        for g in gradients
    ]


def unaliased(value: Any) -> Any:
    """Returns `value`: a read placed in the graph keeps the value it read."""
    return value


def add_to(variable: Any, values: Sequence[Any], where: Any = None) -> None:
    """Adds scalar `values` to the vector variable's entries, one update."""
    added = tf.stack([tf.cast(v, tf.float32) for v in values])
    if where is not None:
        added = tf.where(where, added, tf.zeros_like(added))
    variable.assign_add(added)


def _values(gradient: Any) -> Any:
    """The tensor that holds the numbers of a gradient."""
    return (
        gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    )


def dense_size(gradient: Any) -> Any:
    """Returns the number of entries of the dense equivalent, as float32."""
    return tf.cast(tf.reduce_prod(gradient.dense_shape), tf.float32)


def dense(gradient: Any) -> Any:
    """Returns the dense tensor equal to a `tf.IndexedSlices`."""
    return tf.convert_to_tensor(gradient)


# Training functions.


def check_strategy() -> None:
    """Raises early under ParameterServerStrategy, which `fit` cannot use."""
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ValueError(
            "custom_fit mixins cannot train under ParameterServerStrategy: "
            "Keras 3's TensorFlow trainer has no ClusterCoordinator support, "
            'so `fit` fails there for plain keras.Model as well ("To use '
            "this dataset, you need to pass this dataset to "
            'ClusterCoordinator.create_per_worker_dataset"). Received: '
            f"strategy={type(strategy).__name__}. Use MirroredStrategy or "
            "MultiWorkerMirroredStrategy instead."
        )


def check_compile(jit_compile: Any) -> None:
    """Accepts every `jit_compile` (XLA included)."""
    del jit_compile


def _is_multi_worker(model: Any) -> bool:
    """Returns whether `model` was built under MultiWorkerMirroredStrategy."""
    return isinstance(
        getattr(model, "distribute_strategy", None),
        tf.distribute.MultiWorkerMirroredStrategy,
    )


def build_batch(model: Any, iterator: Iterable[Any]) -> Any:
    """Returns a batch of local tensors for Keras' build before `fit`.

    Keras 3.15 builds the model before `fit` from the first batch, averaged
    across replicas with `strategy.reduce("MEAN", batch)`. Under
    MultiWorkerMirroredStrategy that reduce fails ("Attempt to convert a
    value (PerReplica...) to a Tensor"), for plain `keras.Model` too. Only
    the shapes and dtypes of the batch matter there, so the first replica's
    local tensors serve; under other strategies Keras' own build works
    (`None`).

    Args:
        model: The model being fitted.
        iterator: Keras' epoch iterator, yielding `(begin, end, iterator)`.

    Returns:
        The first batch with every distributed value replaced by its first
        local component, or `None`.
    """
    if not _is_multi_worker(model):
        return None
    strategy = model.distribute_strategy
    for _, _, data_iterator in iterator:
        batch = next(data_iterator)
        break

    def local(value: Any) -> Any:
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(local, batch)


def reducible_logs(model: Any, logs: dict[str, Any]) -> dict:
    """Returns step logs that Keras can reduce across workers.

    Keras 3.15 reduces each log of a step with `strategy.reduce("MEAN", v,
    axis=0)` under MultiWorkerMirroredStrategy, which fails on the scalars
    that every step returns ("Invalid reduction dimension 0 for input with 0
    dimensions"), for plain `keras.Model` too. Scalars are given shape `[1]`:
    the reduce then averages over replicas and that axis, and returns the
    scalar. Under other strategies the logs are returned unchanged.
    """
    if not _is_multi_worker(model):
        return logs
    return {
        name: tf.reshape(value, [1]) if value.shape.rank == 0 else value
        for name, value in logs.items()
    }


class TrainerHooks:
    """No Keras trainer method needs overriding: the step is stateful."""
