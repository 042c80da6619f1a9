"""The backend contract: what every adapter module provides, and nothing more.

`Adapter` lists each function (and the one class) an adapter module
defines, with its meaning; `tests/backend_contract_test.py` checks that
every adapter provides exactly these names, with these parameters (by
importing each). The core calls the
adapter of the backend in use through `custom_fit.backend.current()` and
never names a backend itself.

Dense backends (JAX, PyTorch) share the defaults of `_dense.py`: dense
gradients only, one replica per step (a step traced over the global
batch, or no distribution), no tape-recorded losses.
"""

import contextlib
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import Protocol


class Adapter(Protocol):
    """What custom_fit's core needs of a Keras backend."""

    # Differentiation.

    def value_and_grad(
        self, function: Callable[[], tuple[Any, Any]], variables: Any
    ) -> tuple[Any, Any, list[Any]]:
        """Returns `(value, aux, gradients)` of `function` w.r.t. variables.

        `function` takes no argument and returns `(value, aux)`, `value` a
        scalar; `variables` is a list, or a callable returning it (called
        after `function`, which may build the model). Updates `function`
        makes to other variables (layer state, metrics) are kept.
        """
        ...

    def values_and_grads(
        self, function: Callable[[], tuple[dict[str, Any], Any]], variables: Any
    ) -> tuple[dict[str, Any], Any, dict[str, list[Any]]]:
        """`value_and_grad` of a dict of losses (one backward pass each)."""
        ...

    def per_example_gradients(
        self,
        function: Callable[..., Any],
        variables: Sequence[Any],
        inputs: tuple,
    ) -> tuple[list[Any], bool]:
        """Returns the gradients of each slice of `inputs` (first axis).

        Vectorized where the backend can; also returns whether it was.
        """
        ...

    def input_gradients(
        self, function: Callable[[Any], Any], inputs: Sequence[Any]
    ) -> list[Any]:
        """Returns the gradients of `function(inputs)` w.r.t. `inputs`.

        They are differentiable again (double backpropagation).
        """
        ...

    def intermediate_gradients(
        self, function: Callable[[Callable[[Any], Any]], tuple[Any, Any]]
    ) -> tuple[Any, Any, list[Any]]:
        """Returns `(value, aux, gradients)` of `function(watch)`.

        `function` takes `watch`, a callable that returns the tensor it is
        given, unchanged in value, and marks it; `function` returns
        `(value, aux)`, `value` a scalar. `gradients` are those of `value`
        with respect to the marked tensors (intermediate results, such as
        a layer's output), in the order marked; zeros where `value` does
        not depend on one. Updates `function` makes to variables are kept.
        """
        ...

    def check_recorded_loss(self, tape: Any) -> None:
        """Raises unless `tape` can differentiate a loss it recorded.

        `minimize(loss, tape)`, TensorFlow's form.
        """
        ...

    def recorded_gradients(
        self, tape: Any, value: Any, variables: Sequence[Any]
    ) -> list[Any]:
        """Returns the gradients of `value` recorded on `tape`."""
        ...

    # Numbers.

    def squared_sums(self, gradients: Sequence[Any]) -> Any:
        """Returns a float32 vector: each gradient's sum of squares.

        One entry per gradient (none is `None`; a sparse one has no
        duplicate index), in one fused primitive where the backend has one.
        """
        ...

    def group_sums(self, values: Any, segments: Any, count: int) -> Any:
        """Returns the sums of a float32 vector's entries in `count` groups.

        `segments` (an int32 NumPy vector as long as `values`) gives each
        entry's group; an empty group sums to 0, and a NaN or Inf stays in
        its group. One fused primitive where the backend has one.
        """
        ...

    def scaled(self, gradients: Sequence[Any], factor: Any) -> list[Any]:
        """Returns each gradient times `factor` (a float or scalar tensor).

        In each gradient's dtype; none is `None` (a sparse one keeps its
        indices); in one fused primitive where the backend has one.
        """
        ...

    def add_noise(
        self, tensors: Sequence[Any], stddev: Any, seeds: Any
    ) -> list[Any]:
        """`tensors` plus independent normal noise of `stddev`.

        Advances the `SeedGenerator` `seeds`: one draw per tensor where a
        compiler fuses them, one draw for all on eager PyTorch.
        """
        ...

    def secret_seeds(self, seed: int | None) -> Any:
        """A `keras.random.SeedGenerator` of noise no one may predict.

        Seeded with `seed` where one is given (a reproducible run); else
        from the operating system's entropy, with every secret bit the
        backend's draws (`add_noise`) read: at least 62. Where a variable
        must agree over processes when it is made (JAX), a public
        placeholder, until `agree_on_seeds` gives it process 0's secret.
        """
        ...

    def agree_on_seeds(self, seeds: Any, given: bool) -> None:
        """Gives a `secret_seeds` generator process 0's state everywhere.

        Where several processes each run the step on one model (JAX
        processes, `torch.distributed`), a collective every process calls
        before training. `given`: the seed was given (the same in every
        process). Nothing in one process, nor under `tf.distribute`, whose
        workers take the chief's initial values of the variables made in
        its scope.
        """
        ...

    def check_sampler(self, model: Any, sampler: Any) -> None:
        """Raises where the backend would not feed a sampler's draws whole.

        `tf.distribute` over several workers (the strategy `model` was made
        under, or the one in scope) splits the batches itself, each worker
        reading its own sampler: the workers' draws would not make one draw
        per step.
        """
        ...

    def compiled(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """A pure `function` of tensors, for a few calls outside the step.

        Compiled where the backend's eager operations each compile on their
        first call (JAX: `jax.jit`, one compilation for the whole
        function); as it is elsewhere.
        """
        ...

    def local_values(self, variables: Sequence[Any]) -> list[Any]:
        """The variables' values, for a computation in this process alone.

        Outside the step (a check before `fit`): the values themselves,
        or where they are laid out over several processes (JAX), host
        copies of this process' replicated values.
        """
        ...

    def divisible_first_axis(
        self, tensor: Any, count: int, message: str
    ) -> Any:
        """Returns `tensor`; fails with `message` unless `count` divides it.

        Its first axis, checked at trace time where shapes are static.
        """
        ...

    # Replicas.

    def replica_count(self) -> int:
        """The number of replicas whose gradients are summed per step."""
        ...

    def all_reduce_sum(self, gradients: Sequence[Any]) -> list[Any]:
        """Sums gradients across replicas (`None` stays `None`)."""
        ...

    def batch_gradients(self, gradients: Sequence[Any]) -> list[Any]:
        """The global batch's gradients from this replica's.

        Each replica's gradients are those of its loss as Keras computes
        it: divided by the replica count under `tf.distribute` (summed
        here), a mean over its own examples over `torch.distributed`
        processes (a mean weighted by batch sizes). `None` stays `None`.
        """
        ...

    def summed_count(self, count: Any) -> Any:
        """The global batch's count from this replica's `count`."""
        ...

    def summed_results(
        self, metrics: Sequence[Any], compute: Callable[[], Any]
    ) -> Any:
        """`compute()` on the global states of `metrics`.

        Where each process holds its own metric states (PyTorch), they are
        summed over the processes while `compute` runs.
        """
        ...

    def data_shards(self) -> tuple[int, int]:
        """How `fit`'s input is split: `(shares, this process' share)`.

        `shares` counts the different shares of every global batch that
        the processes feed `fit`: one per `torch.distributed` process; under
        a `keras.distribution`, one per group of JAX processes at the same
        positions of the mesh's batch axis; `(1, 0)` elsewhere
        (`tf.distribute` splits the global batch itself).
        """
        ...

    def gather_from_processes(self, values: Sequence[int]) -> Any:
        """Every process' `values`, as a NumPy int64 array.

        One collective over the processes of `data_shards()`; row `i` holds
        process `i`'s values (one row in one process). Each value is an
        integer in `[0, 2**31)`.
        """
        ...

    def fit_callbacks(
        self, model: Any, callbacks: list[Any], x: Any
    ) -> list[Any]:
        """The callbacks `model.fit` runs, from the user's and its data `x`.

        Over several processes (PyTorch's, JAX's under a distribution,
        TensorFlow's workers) the files are written once (`_writers`: the
        writing callbacks in the first process only, or in every process
        with the others' files in a scratch directory; `BackupAndRestore`
        restoring everywhere). On PyTorch, a sampler's `set_epoch` added.
        """
        ...

    def writes_files(self, model: Any) -> bool:
        """Whether this process writes the run's files.

        True in one process, and in the first of several that train
        `model` together (PyTorch's rank 0, JAX's process 0, TensorFlow's
        chief worker).
        """
        ...

    def on_first_replica(self, value: Any) -> Any:
        """`value` on the first replica, 0 on the others."""
        ...

    # Conditional updates and writes.

    def run_if(
        self,
        condition: Any,
        function: Callable[..., object],
        args: tuple[Any, ...] = (),
        synchronized: bool = False,
    ) -> None:
        """Runs `function(*args)` only when the scalar `condition` is true.

        `synchronized`: `function` synchronises replicas.
        """
        ...

    def restore_if(
        self, condition: Any, variables: Sequence[Any], values: Sequence[Any]
    ) -> None:
        """Writes `values` into per-replica `variables` where `condition`."""
        ...

    def assign_variables(
        self, variables: Sequence[Any], values: Sequence[Any]
    ) -> None:
        """Assigns `values` to model variables, in a replica context too."""
        ...

    def apply_gradients(
        self,
        optimizer: Any,
        gradients: Sequence[Any],
        variables: Sequence[Any],
        tracked: Sequence[Any],
    ) -> None:
        """Applies `gradients` to `variables` with the Keras optimizer.

        `tracked` lists the variables the optimizer was built for, in its
        order (what a stateless apply takes the values of).
        """
        ...

    def add_to(
        self, variable: Any, values: Sequence[Any], where: Any = None
    ) -> None:
        """Adds scalar `values` to a float32 vector variable's entries.

        One value per entry, in order (Python numbers or scalar tensors),
        in one update (on an eager backend, in place, without a dispatch
        per value). With `where`, a boolean scalar tensor, nothing is
        added where it is false, NaN values included.
        """
        ...

    # custom_fit's own state.

    def state_variable(
        self,
        shape: Sequence[int],
        dtype: str,
        name: str,
        summed: bool = False,
        like: Any = None,
    ) -> Any:
        """Returns a zero-initialized state variable.

        `summed`: a read sums the replicas' copies; `like`: a model
        variable whose layout it takes.
        """
        ...

    def collected(self) -> list[Any]:
        """The list where a step keeps values collected for later use.

        Its items are objects with a `leaves` attribute (a tuple of
        tensors or `None`). On a stateless backend the list is the current
        pure scope's, and a pure run (a transformation such as
        `value_and_grad`) carries the items made inside it out to its
        enclosing scope, their leaves replaced by the values outside; a
        run whose results are dropped drops them too. Elsewhere, one list
        per thread.
        """
        ...

    def creation_scope(self) -> contextlib.AbstractContextManager:
        """A context lifting state made in a traced step out of the trace."""
        ...

    def model_scope(self, model: Any) -> contextlib.AbstractContextManager:
        """A context in which state made for `model` is the model's own.

        For state made outside a step: under `tf.distribute`, in the
        model's strategy's scope (one copy per replica).
        """
        ...

    def read(self, variable: Any) -> Any:
        """The current value of a variable, inside a step."""
        ...

    def copy(self, value: Any) -> Any:
        """A copy of a variable's current value, untouched by later writes."""
        ...

    def host_value(self, model: Any, variable: Any) -> Any:
        """A variable's value on the host (a NumPy array), during `fit` too."""
        ...

    def unaliased(self, value: Any) -> Any:
        """A value that later in-place writes leave as it is now.

        On a backend whose variables are updated in place, a copy of a
        tensor that shares a variable's storage (the variable's own tensor,
        a view of it); any other value as it is.
        """
        ...

    def read_late(self, variable: Any) -> None:
        """Marks a scalar state variable that the host reads (`snapshot`).

        A stateless step returns such a variable once more, beside the
        state it donates to its next call, so that a read one call later
        needs no copy; other state is returned once.
        """
        ...

    def snapshot(self, model: Any, variable: Any) -> Any:
        """A variable's latest value, without waiting for the step making it.

        For a check made one call of the train function later (`fetch`),
        so that the host never waits for the step that just started.
        """
        ...

    def fetch(self, value: Any) -> Any:
        """A value of `snapshot` on the host (a NumPy array)."""
        ...

    def write_latest(self, model: Any) -> None:
        """Writes the latest state of a running `fit` into the variables."""
        ...

    def after_state_sync(self, model: Any) -> None:
        """Writes custom_fit's stashed state after Keras' own state sync."""
        ...

    # Sparse gradients.

    def is_sparse(self, gradient: Any) -> bool:
        """Whether `gradient` is sparse (TensorFlow's `IndexedSlices`)."""
        ...

    def map_values(self, function: Callable[[Any], Any], gradient: Any) -> Any:
        """Applies `function` to the values of a sparse gradient."""
        ...

    def deduplicate(self, gradient: Any) -> Any:
        """Sums the rows of a sparse gradient that share an index."""
        ...

    def dense_size(self, gradient: Any) -> Any:
        """The number of entries of the dense equivalent, as float32."""
        ...

    def dense(self, gradient: Any) -> Any:
        """The dense tensor equal to a sparse gradient."""
        ...

    # Training functions.

    def check_strategy(self) -> None:
        """Raises early for a distribution that `fit` cannot use."""
        ...

    def forward(
        self, model: Any, call: Callable[..., Any], x: Any, training: bool
    ) -> Any:
        """`call(model, x, training=training)`: the model's forward pass.

        On PyTorch with `jit_compile=True`, under `torch.compile`.
        """
        ...

    def check_compile(self, jit_compile: Any) -> None:
        """Raises `ValueError` for a `jit_compile` the step cannot run.

        `jit_compile` is the value `compile` resolved; every backend
        accepts every value today.
        """
        ...

    def make_step_function(
        self,
        model: Any,
        kind: str,
        build_keras_function: Callable[[], Any],
        own_state: Callable[[], list[Any]],
    ) -> Any:
        """Returns the `"train"` or `"test"` function Keras' loop calls.

        `own_state` returns custom_fit's own state variables of the model
        and its networks (those of `custom_fit._state.StateHolder`), which
        a pure step carries beside Keras' state.
        """
        ...

    def build_batch(self, model: Any, iterator: Iterable[Any]) -> Any:
        """A batch for Keras' build before `fit`, or `None` for Keras' own."""
        ...

    def reducible_logs(self, model: Any, logs: dict[str, Any]) -> dict:
        """The step's logs in a form Keras can reduce across workers."""
        ...

    # The class mixed into `TrainStepMixin`: Keras trainer methods that
    # the backend needs overridden (JAX's `jax_state_sync`).
    TrainerHooks: type


def names() -> tuple[str, ...]:
    """Returns the names every adapter module provides."""
    members = [
        name
        for name in vars(Adapter)
        if not name.startswith("_") and callable(getattr(Adapter, name))
    ]
    return (*members, *Adapter.__annotations__)
