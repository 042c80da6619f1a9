"""The machinery of a stateless step, for any backend that has one.

Keras' JAX trainer passes the model's state through a pure step function,
`train_step(state, data) -> (logs, state)`. custom_fit keeps one
imperative step for every backend; an adapter whose step is stateless
(JAX's) runs it with what this module holds, in which nothing but the
backend's own transformations differs from one such backend to another:

- `Scope`: a `keras.StatelessScope` that remembers what was updated, and
  the stack of them (`current`, `entered`, `child`, `write_back`);
- `PureRun`: a function of some variables' values, run in a child scope,
  with the updates it made collected as outputs (what a transformation
  such as `jax.value_and_grad` differentiates);
- `StepFunction`: the train or test function: the state mapped onto its
  variables, the step run, the new values collected, custom_fit's own
  state carried beside Keras', the state a step makes discovered by an
  abstract trace before the first compiled call; a backend subclasses it
  with its abstract trace, its compiler and its placement of the state;
- `LATEST`: each model's latest state while `fit` runs.

It imports no backend library: the adapter hands it its
transformations.
"""

import contextlib
import threading
import weakref
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from custom_fit.backend import _dense

_LOCAL = threading.local()
# Whether Keras' JAX epoch iterator stacks the batches of an execution
# (`steps_per_execution > 1`) into one item: from Keras 3.16.
_SUPER_BATCHES = _dense.keras_at_least((3, 16))


class Scope(keras.StatelessScope):
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
        # Items collected in the scope (see `collected`).
        self.collected: list[Any] = []

    def add_update(self, update: tuple[Any, Any]) -> None:
        variable, value = update
        self.updated[id(variable)] = variable
        super().add_update(update)


def _stack() -> list[Scope]:
    if not hasattr(_LOCAL, "scopes"):
        _LOCAL.scopes = []
    return _LOCAL.scopes


def current() -> Scope | None:
    scopes = _stack()
    return scopes[-1] if scopes else None


@contextlib.contextmanager
def entered(scope: Scope) -> Iterator[Scope]:
    """Enters `scope` and makes it the current custom_fit scope."""
    _stack().append(scope)
    try:
        with scope:
            yield scope
    finally:
        _stack().pop()


def collected() -> list[Any]:
    """Returns the current scope's collected items (else this thread's).

    Items have a `leaves` attribute; `PureRun` carries those made in its
    run out to the enclosing scope.
    """
    scope = current()
    if scope is not None:
        return scope.collected
    if not hasattr(_LOCAL, "collected"):
        _LOCAL.collected = []
    return _LOCAL.collected


def child(overrides: Iterable[tuple[Any, Any]] = ()) -> Scope:
    """Returns a scope starting from the current one's values."""
    parent = current()
    mapping = dict(parent.state_mapping) if parent is not None else {}
    for variable, value in overrides:
        mapping[id(variable)] = value
    return Scope(mapping, collect_losses=True)


def write_back(scope: Scope, skip: frozenset[int] = frozenset()) -> None:
    """Records the updates of a finished child scope in its parent.

    Outside any custom_fit scope (a call outside `fit`), the variables are
    assigned directly.
    """
    parent = current()
    if parent is not None:
        parent.collected.extend(scope.collected)
    else:
        collected().extend(scope.collected)
    for key, variable in scope.updated.items():
        if key in skip:
            continue
        value = scope.state_mapping[key]
        if parent is not None:
            parent.add_update((variable, value))
        else:
            variable.assign(value)


# The key of the collected items' leaves among a pure run's updates (the
# others are ids of variables, never negative).
_COLLECTED = -1


class PureRun:
    """Runs a function of variables' values in a child scope, purely.

    Each call maps `variables` to the values given, runs the function in a
    child of the current scope, and returns its result with the values of
    every variable it updated (a transformation must return them: values
    made inside it cannot leave it otherwise), and the leaves of the items
    collected in it (under the key `_COLLECTED`). `finish` then records
    those updates and items in the enclosing scope.

    Args:
        variables: The variables whose values each call is given.
    """

    def __init__(self, variables: Sequence[Any] = ()) -> None:
        self.variables = list(variables)
        self._scopes: list[Scope] = []

    def __call__(
        self, values: Sequence[Any], function: Callable[..., Any], *args: Any
    ) -> tuple[Any, dict[int, Any]]:
        """Returns `(function(*args), updates)`, run on `values`."""
        scope = child(zip(self.variables, values))
        with entered(scope):
            result = function(*args)
        self._scopes.append(scope)
        updates: dict[int, Any] = {
            key: scope.state_mapping[key] for key in scope.updated
        }
        if scope.collected:
            updates[_COLLECTED] = [item.leaves for item in scope.collected]
        return result, updates

    def finish(self, updates: dict[int, Any], skip_variables: bool) -> None:
        """Records the last call's `updates` in the enclosing scope.

        Args:
            updates: The updates the transformed function returned.
            skip_variables: Bool. Leave out `variables` themselves (their
                values were the function's arguments).
        """
        scope = self._scopes[-1]
        updates = dict(updates)
        for item, leaves in zip(scope.collected, updates.pop(_COLLECTED, [])):
            item.leaves = tuple(leaves)
        scope.state_mapping.update(updates)
        skip = (
            frozenset(id(v) for v in self.variables)
            if skip_variables
            else frozenset()
        )
        write_back(scope, skip=skip)


# The scalar state variables the host reads one call late (`read_late`).
READ_LATE: "weakref.WeakValueDictionary[int, Any]" = (
    weakref.WeakValueDictionary()
)


def read_late(variable: Any) -> None:
    """Marks a scalar state variable that the host reads one call late.

    The step returns it once more, outside the state it donates. Called
    when the variable is made, before any step carries it (the copies a
    compiled step returns follow the marks made when it was traced).
    """
    READ_LATE[id(variable)] = variable


# The state of each model's latest call of a train or test function, while
# `fit` runs (Keras writes it into the variables at the end of an epoch).
LATEST: "weakref.WeakKeyDictionary[Any, Latest]" = weakref.WeakKeyDictionary()


def latest_value(model: Any, variable: Any) -> Any:
    """The variable's value in the model's latest state, else its own."""
    latest = LATEST.get(model)
    value = None if latest is None else latest.get(variable)
    return variable.value if value is None else value


def write_latest(model: Any) -> None:
    """Writes the state of the model's last call into the variables."""
    latest = LATEST.get(model)
    if latest is not None:
        latest.write()


class Layout:
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


class Latest:
    """The state returned by the last call, readable per variable.

    Keras' state (its groups of variables) and custom_fit's own state (the
    last group) of the model's latest call of a train or test function.
    """

    def __init__(
        self, layout: Layout, state: tuple, scalars: list[Any]
    ) -> None:
        self.layout = layout
        self.state = state
        scalar_values = iter(scalars)
        # The undonated copies of the scalars the host reads late.
        self.scalars = {
            id(variable): next(scalar_values)
            for variable in layout.groups[-1]
            if id(variable) in READ_LATE
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


# Set while `StepFunction.discover` traces a step for its state (per thread).
_DISCOVERING = threading.local()


def discovering() -> bool:
    """Whether the running trace only discovers the state a step makes.

    Such a trace computes nothing that is kept: a backward pass, which
    makes no state, can be left out of it (gradients of zeros).
    """
    return bool(getattr(_DISCOVERING, "active", False))


class StepFunction:
    """A stateless trainer's train or test function, around the step.

    Called as Keras calls its own (its JAX trainer's): `(state, iterator)
    -> (logs, state)`,
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
        self._layout: Layout | None = None
        # The latest state of a running call, put back if it raises.
        self._held: tuple | None = None
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
        with entered(Scope(mapping, collect_losses=True)) as scope:
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
                "custom_fit made new state while a stateless step was traced: "
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
        # The scalars read late of custom_fit's state once more, in buffers
        # the next call does not take over (it donates the state): the host
        # reads them a call later (`snapshot`) without a copy of its own.
        scalars = [
            ops.copy(value)
            for variable, value in zip(own_variables, new_own)
            if id(variable) in READ_LATE
        ]
        return logs, new_state, new_own, scalars

    def discover(self, state: tuple, data: Any) -> tuple:
        """Traces the step once abstractly, to make the state it makes.

        The step makes some of its state when first run (the metrics of
        `report_metric`, inspection's figures, accumulation's sums, an
        optimizer built at its first update): it is traced once abstractly
        (`_abstract`: shapes only, no op runs, nothing is compiled), in a
        scope of the current values. Variables made there are
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
        _DISCOVERING.active = True
        try:
            with entered(Scope(values, collect_losses=True)):
                self._abstract(self._run, data)
        finally:
            _DISCOVERING.active = False
        self.discovered = True
        return tuple(
            [values.get(id(v), None) if id(v) in values else v.value for v in g]
            for g in self.groups()
        )

    def eager(self) -> bool:
        """Whether the step runs op by op (`run_eagerly`, no `jit_compile`)."""
        return bool(self.model.run_eagerly or not self.model.jit_compile)

    def _compiled(self, state: tuple, own: list[Any]) -> Any:
        """Returns the step function: compiled (`_compile`) unless eager."""
        if self.eager():
            return self._stateless
        return self._compile(state, own)

    # What the backend provides.

    def _abstract(self, function: Callable[..., Any], *args: Any) -> Any:
        """Traces `function(*args)` for shapes only: no op runs."""
        raise NotImplementedError

    def _compile(self, state: tuple, own: list[Any]) -> Any:
        """Returns `_stateless` compiled, for a first call on this state."""
        raise NotImplementedError

    def _placed(self, state: tuple, own: list[Any]) -> tuple[tuple, list]:
        """Returns the state laid out as the compiled step returns it."""
        return state, own

    def own_values(self, own_variables: list[Any]) -> list[Any]:
        """The current values of custom_fit's state, for the next call."""
        latest = LATEST.get(self.model)
        values = []
        for variable in own_variables:
            value = latest.get(variable) if latest is not None else None
            values.append(variable.value if value is None else value)
        return values

    def __call__(self, state: tuple, iterator: Any) -> tuple[Any, tuple]:
        # Keras' trainer took the variables' values out for the call (JAX
        # frees them): a step that raises (a refusal found when it is
        # traced, a user's hook) puts back the latest state it holds, so
        # that the model keeps its weights.
        self._held = state
        try:
            return self._call(state, iterator)
        except BaseException:
            self._put_back(self._held)
            raise
        finally:
            self._held = None

    def batches_of_call(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The batches one call runs, from the epoch's iterator.

        Up to Keras 3.15 each item of the iterator is one batch, and a call
        takes up to `steps_per_execution` of them. From Keras 3.16, with
        `steps_per_execution > 1`, a call takes one item: the batches of
        one execution stacked along a new first axis, or, where they could
        not be stacked (a shorter last batch), a list of them (a `list`
        subclass; a batch itself is never a list subclass).
        """
        steps = self.model.steps_per_execution
        if steps == 1 or not _SUPER_BATCHES:
            return iterator
        item = next(iterator)
        if isinstance(item, list) and type(item) is not list:
            return iter(list(item))
        count = next(v for v in keras.tree.flatten(item) if v is not None)
        return iter(
            [
                keras.tree.map_structure(
                    lambda v, i=i: None if v is None else v[i], item
                )
                for i in range(count.shape[0])
            ]
        )

    def _put_back(self, state: tuple) -> None:
        """Writes `state` into the variables (those it still holds)."""
        for variables, values in zip(self.groups(), state):
            for variable, value in zip(variables, values):
                try:
                    variable.assign(value)
                except Exception:  # noqa: BLE001  (a value given away)
                    pass

    def _call(self, state: tuple, iterator: Any) -> tuple[Any, tuple]:
        iterator = self.batches_of_call(iter(iterator))
        data = next(iterator)
        if not self.discovered and not self.eager():
            # Op by op, the first step makes its state itself (`_stateless`):
            # an abstract trace would show a user's hooks tracers.
            state = self._held = self.discover(state, data)
        extras = [variable.value for variable in self.extra_variables()]
        own_variables = self.own_variables()
        own = self.own_values(own_variables)
        if self.step is None:
            self.step = self._compiled(state, own)
            # As the step will return it, so that it compiles once.
            state, own = self._placed(state, own)
            self._held = state
        logs, state, own, scalars = self.step(state, own, data, extras)
        self._held = state
        for _ in range(self.model.steps_per_execution - 1):
            try:
                data = next(iterator)
            except StopIteration:
                break
            logs, state, own, scalars = self.step(state, own, data, extras)
            self._held = state
        layout = self._layout
        sizes = [*(len(g) for g in state), len(own)]
        if layout is None or layout.sizes != sizes:
            layout = self._layout = Layout(
                [*self.groups(), self.own_variables()]
            )
        LATEST[self.model] = Latest(layout, (*state, own), scalars)
        return logs, state
