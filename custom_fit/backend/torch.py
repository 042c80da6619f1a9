"""The PyTorch adapter: eager steps, `torch.autograd`, `torch.func`.

Keras' PyTorch trainer runs the step eagerly (with `jit_compile=True`,
custom_fit compiles the forward pass: `_torch_compile`), statefully: a
variable's value is a `torch.nn.Parameter` that the optimizer updates in
place. custom_fit keeps the step Keras builds and runs its own
`train_step` in it, as on TensorFlow:

- Gradients come from `torch.autograd.grad` of the loss with respect to
  the variables' parameters (never `.backward()`, so no `.grad` is left
  behind), under `torch.enable_grad()`: Keras runs `evaluate`'s step
  under `torch.no_grad()`, where an input-gradient penalty must still
  differentiate.
- Per-example gradients are `torch.func.vmap` of `torch.func.grad` of a
  function that runs the model in a `keras.StatelessScope` on the values
  passed in (`torch.func.functional_call` does not reach Keras
  variables), with `randomness="different"` so that dropout draws per
  example.
- A conditional update reads its condition on the host (`bool(tensor)`):
  the step is eager, and Keras' loop reads each step's logs on the host
  anyway. Measured here on the MLP of the benchmarks: the read took
  about 0.01 ms, against 0.4-0.5 ms (13% of the step) for a snapshot of
  the state and a `torch.where` per variable.
- A variable's value is the parameter itself, which the optimizer updates
  in place: every value kept for later (`read`, `copy`) is a clone.

Keras 3.15 has no PyTorch distribution; data parallelism over
`torch.distributed` processes (one replica each) is
`custom_fit.backend._torch_processes`.
"""

import contextlib
import hashlib
import secrets
import struct
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import torch

from custom_fit.backend import _torch_compile
from custom_fit.backend import _torch_processes
from custom_fit.backend._dense import build_batch  # noqa: F401
from custom_fit.backend._dense import check_compile  # noqa: F401
from custom_fit.backend._dense import check_recorded_loss  # noqa: F401
from custom_fit.backend._dense import check_sampler  # noqa: F401
from custom_fit.backend._dense import deduplicate  # noqa: F401
from custom_fit.backend._dense import dense  # noqa: F401
from custom_fit.backend._dense import dense_size  # noqa: F401
from custom_fit.backend._dense import divisible_first_axis  # noqa: F401
from custom_fit.backend._dense import dtype_groups as _dtype_groups
from custom_fit.backend._dense import is_sparse  # noqa: F401
from custom_fit.backend._dense import keras_at_least as _keras_at_least
from custom_fit.backend._dense import map_values  # noqa: F401
from custom_fit.backend._dense import model_scope  # noqa: F401
from custom_fit.backend._dense import recorded_gradients  # noqa: F401
from custom_fit.backend._dense import reducible_logs  # noqa: F401
from custom_fit.backend._dense import replica_count  # noqa: F401
from custom_fit.backend._stateful import after_state_sync  # noqa: F401
from custom_fit.backend._stateful import collected  # noqa: F401
from custom_fit.backend._stateful import read_late  # noqa: F401
from custom_fit.backend._stateful import write_latest  # noqa: F401
from custom_fit.backend._torch_processes import all_reduce_sum  # noqa: F401
from custom_fit.backend._torch_processes import batch_gradients  # noqa: F401
from custom_fit.backend._torch_processes import data_shards  # noqa: F401
from custom_fit.backend._torch_processes import fit_callbacks  # noqa: F401
from custom_fit.backend._torch_processes import gather_from_processes  # noqa: F401
from custom_fit.backend._torch_processes import on_first_replica  # noqa: F401
from custom_fit.backend._torch_processes import summed_count  # noqa: F401
from custom_fit.backend._torch_processes import summed_results  # noqa: F401
from custom_fit.backend._torch_processes import writes_files  # noqa: F401


def _parameter(variable: Any) -> Any:
    """The tensor a loss is differentiated by: the variable's parameter."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _gradients(value: Any, variables: Sequence[Any], **kwargs: Any) -> list:
    """`torch.autograd.grad` of `value`; `None` where it does not depend.

    Variables that do not require gradients (frozen since the list was
    made) get `None`, as a tape gives for an unwatched variable.
    """
    parameters = [_parameter(v) for v in variables]
    wanted = [i for i, p in enumerate(parameters) if p.requires_grad]
    gradients: list[Any] = [None] * len(parameters)
    if not wanted or not value.requires_grad:
        return gradients
    found = torch.autograd.grad(
        value, [parameters[i] for i in wanted], allow_unused=True, **kwargs
    )
    for i, gradient in zip(wanted, found):
        gradients[i] = gradient
    return gradients


# Differentiation.


def value_and_grad(
    function: Callable[[], tuple[Any, Any]], variables: Any
) -> tuple[Any, Any, list[Any]]:
    """Returns `(value, aux, gradients)` of `function` w.r.t. `variables`.

    See `custom_fit.backend.tensorflow.value_and_grad`: here one
    `torch.autograd.grad` (no `.grad` attribute is written).
    """
    with torch.enable_grad():
        value, aux = function()
        if callable(variables):
            variables = variables()
        gradients = _gradients(value, list(variables))
    return value, aux, gradients


def values_and_grads(
    function: Callable[[], tuple[dict[str, Any], Any]], variables: Any
) -> tuple[dict[str, Any], Any, dict[str, list[Any]]]:
    """Returns the values, aux and gradients of several scalar losses.

    One forward pass, then one backward pass per loss through the same
    graph (kept until the last).
    """
    with torch.enable_grad():
        values, aux = function()
        if callable(variables):
            variables = variables()
        variables = list(variables)
        names = list(values)
        gradients = {
            name: _gradients(
                values[name], variables, retain_graph=i < len(names) - 1
            )
            for i, name in enumerate(names)
        }
    return values, aux, gradients


def unaliased(value: Any) -> Any:
    """Returns `value`, copied when it shares a variable's storage.

    A variable's own tensor (a `torch.nn.Parameter`) and views of one (an
    entry, a slice) change with the variable's in-place updates.
    """
    if isinstance(value, torch.Tensor) and (
        isinstance(value, torch.nn.Parameter) or value._base is not None
    ):
        return value.detach().clone()
    return value


def add_to(variable: Any, values: Sequence[Any], where: Any = None) -> None:
    """Adds scalar `values` to the vector variable's tensor, in place.

    One `add_` (the values stacked with `torch.stack`), where `assign_add`
    of Keras would convert, cast and dispatch several ops.
    """
    target = _parameter(variable)
    with torch.no_grad():
        added = torch.stack(
            [
                torch.as_tensor(v, dtype=target.dtype, device=target.device)
                for v in values
            ]
        )
        if where is not None:
            added = torch.where(torch.as_tensor(where), added, 0.0)
        target.add_(added)


def squared_sums(gradients: Sequence[Any]) -> Any:
    """Returns each gradient's float32 sum of squares, as one vector.

    `torch._foreach_norm` takes the norms of the whole list in one fused
    call (as `torch.nn.utils.clip_grad_norm_` does); an eager step would
    otherwise dispatch two ops per gradient.
    """
    tensors = [
        g if g.dtype == torch.float32 else g.to(torch.float32)
        for g in gradients
    ]
    return torch.stack(torch._foreach_norm(tensors, 2)).square()


def group_sums(values: Any, segments: Any, count: int) -> Any:
    """Returns the sum of `values` in each of `count` groups.

    One `index_add`, where Keras' `segment_sum` on PyTorch dispatches
    several ops (a sort and `repeat_interleave` among them).
    """
    values = torch.as_tensor(values)
    index = torch.as_tensor(segments, dtype=torch.int64, device=values.device)
    return torch.zeros(
        count, dtype=values.dtype, device=values.device
    ).index_add_(0, index, values)


def scaled(gradients: Sequence[Any], factor: Any) -> list[Any]:
    """Returns each gradient times `factor`, in one fused call per dtype.

    `torch._foreach_mul` (as Keras' PyTorch optimizers use `_foreach_*`):
    an eager step would otherwise dispatch one op per gradient.
    """
    tensors = list(gradients)
    dtypes = {g.dtype for g in tensors}
    if len(dtypes) != 1:
        return [g * torch.as_tensor(factor, dtype=g.dtype) for g in tensors]
    dtype = dtypes.pop()
    factor = torch.as_tensor(factor, dtype=dtype, device=tensors[0].device)
    return list(torch._foreach_mul(tensors, factor))


def per_example_gradients(
    function: Callable[..., Any], variables: Sequence[Any], inputs: tuple
) -> tuple[list[Any], bool]:
    """Returns the gradient of `function` for each slice of `inputs`.

    `torch.func.vmap` of `torch.func.grad` of the function run in a
    `keras.StatelessScope` on the values passed in; updates it makes
    (random seeds) stay inside it, so each slice sees the step's state.
    Where an op cannot be vectorized, the slices are differentiated one
    after another (the second result is then `False`).
    """
    variables = list(variables)

    def pure(values: list[Any], args: tuple) -> Any:
        mapping = list(zip(variables, values))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
            return function(*args)

    start = [_parameter(v).detach() for v in variables]
    try:
        with torch.enable_grad():
            gradients = torch.func.vmap(
                torch.func.grad(pure),
                in_dims=(None, 0),
                randomness="different",
            )(start, inputs)
        return list(gradients), True
    except (RuntimeError, NotImplementedError):  # an op vmap cannot batch
        pass
    size = keras.tree.flatten(inputs)[0].shape[0]
    rows = []
    for i in range(size):
        row = keras.tree.map_structure(
            lambda t, i=i: None if t is None else t[i], inputs
        )
        with torch.enable_grad():
            gradients = _gradients(function(*row), variables)
        rows.append(
            [
                torch.zeros_like(_parameter(v)) if g is None else g
                for g, v in zip(gradients, variables)
            ]
        )
    return [torch.stack(column) for column in zip(*rows)], False


def input_gradients(
    function: Callable[[Any], Any], inputs: Sequence[Any]
) -> list[Any]:
    """Returns the gradients of `function(inputs)` w.r.t. tensors `inputs`.

    Differentiable again (`create_graph=True`: double backpropagation), and
    taken under `torch.enable_grad()` also in `evaluate`, whose step Keras
    runs under `torch.no_grad()`. Inputs the value does not depend on get
    zero gradients. The forward passes inside run eagerly: AOTAutograd
    cannot differentiate a compiled one twice (`jit_compile=True`).
    """
    with torch.enable_grad(), _torch_compile.eager("is differentiated twice"):
        inputs = [
            keras.ops.convert_to_tensor(x).detach().requires_grad_(True)
            for x in inputs
        ]
        value = function(inputs)
        found = torch.autograd.grad(
            value, inputs, create_graph=True, allow_unused=True
        )
    return [
        torch.zeros_like(x) if g is None else g for g, x in zip(found, inputs)
    ]


def intermediate_gradients(
    function: Callable[[Callable[[Any], Any]], tuple[Any, Any]],
) -> tuple[Any, Any, list[Any]]:
    """Returns `(value, aux, gradients)` of `function(watch)`.

    See `custom_fit.backend.tensorflow.intermediate_gradients`: here one
    `torch.autograd.grad` with respect to the watched tensors, which are
    nodes of the graph already (a tensor that does not require gradients
    gets zeros). The forward passes inside run eagerly: a compiled one
    (`jit_compile=True`) would not see the tensors watched inside it.
    """
    watched: list[Any] = []

    def watch(tensor: Any) -> Any:
        watched.append(tensor)
        return tensor

    with torch.enable_grad(), _torch_compile.eager("watches tensors inside"):
        value, aux = function(watch)
        wanted = [i for i, t in enumerate(watched) if t.requires_grad]
        found: Sequence[Any] = ()
        if wanted and value.requires_grad:
            found = torch.autograd.grad(
                value, [watched[i] for i in wanted], allow_unused=True
            )
    gradients = [torch.zeros_like(t) for t in watched]
    for i, gradient in zip(wanted, found):
        if gradient is not None:
            gradients[i] = gradient
    return value, aux, gradients


# Conditional updates.


def run_if(
    condition: Any,
    function: Callable[..., object],
    args: tuple[Any, ...] = (),
    synchronized: bool = False,
) -> None:
    """Runs `function(*args)` only when `condition` is true (read on host)."""
    del synchronized
    if bool(condition):
        function(*args)


def apply_gradients(
    optimizer: Any,
    gradients: Sequence[Any],
    variables: Sequence[Any],
    tracked: Sequence[Any],
) -> None:
    """Applies `gradients` with `optimizer.apply`, under `torch.no_grad()`.

    As Keras' PyTorch trainer applies them: the update is not recorded.
    """
    del tracked
    with torch.no_grad():
        _torch_compile.apply(optimizer, list(gradients), list(variables))


def assign_variables(variables: Sequence[Any], values: Sequence[Any]) -> None:
    """Assigns `values` to `variables`."""
    for variable, value in zip(variables, values):
        variable.assign(value)


def restore_if(
    condition: Any, variables: Sequence[Any], values: Sequence[Any]
) -> None:
    """Writes `values` back into `variables` when `condition` (on host)."""
    if bool(condition):
        assign_variables(variables, values)


# State.


def state_variable(
    shape: Sequence[int],
    dtype: str,
    name: str,
    summed: bool = False,
    like: Any = None,
) -> keras.Variable:
    """Returns a zero-initialized, non-trainable Keras variable.

    Over several processes, one not `summed` logs the first process'
    value; `like` has no meaning on one device.
    """
    del like
    variable = keras.Variable(
        initializer=keras.initializers.Zeros(),
        shape=shape,
        dtype=dtype,
        trainable=False,
        name=name,
    )
    if not summed:
        _torch_processes.mark_not_summed(variable)
    return variable


def creation_scope() -> contextlib.AbstractContextManager:
    """Returns a context that does nothing: the step is eager."""
    return contextlib.nullcontext()


def read(variable: Any) -> Any:
    """Returns a copy of a variable's current value.

    The value itself is the parameter, which later writes change in place.
    """
    return _parameter(variable).clone()


def copy(value: Any) -> Any:
    """Returns a copy of a value, untouched by later in-place writes."""
    return keras.ops.convert_to_tensor(_parameter(value)).detach().clone()


def host_value(model: Any, variable: Any) -> np.ndarray:
    """Returns a variable's value on the host (the variables are current)."""
    del model
    return np.asarray(keras.ops.convert_to_numpy(_parameter(variable)))


def snapshot(model: Any, variable: Any) -> Any:
    """Returns a copy of the variable's tensor (queued on a GPU, not read)."""
    del model
    return _parameter(variable).detach().clone()


def fetch(value: Any) -> np.ndarray:
    """Returns the value of `snapshot` on the host."""
    return np.asarray(keras.ops.convert_to_numpy(value))


# Training functions.


def secret_seeds(seed: int | None) -> Any:
    """Returns a generator seeded with `seed`, or with 62 secret bits.

    The state is two int32 words, `[seed, counter]`; without a seed both
    are drawn from the operating system (31 bits each), and `_normal`
    reads them whole.
    """
    if seed is not None:
        return keras.random.SeedGenerator(seed)
    seeds = keras.random.SeedGenerator(secrets.randbits(31))
    seeds.state.assign(
        np.asarray([secrets.randbits(31), secrets.randbits(31)], np.int32)
    )
    return seeds


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """Returns `function`: PyTorch's eager operations start fast."""
    return function


def local_values(variables: Sequence[Any]) -> list[Any]:
    """Returns the variables' tensors (each process holds its own)."""
    return [variable.value for variable in variables]


def agree_on_seeds(seeds: Any, given: bool) -> None:
    """Assigns process 0's generator state in every process."""
    del given  # a given seed is the same everywhere: broadcast alike
    if _torch_processes.world_size() == 1:
        return
    device = torch.device("cpu")
    if torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    value = torch.as_tensor(seeds.state.value).detach().clone().to(device)
    torch.distributed.broadcast(value, src=0)
    seeds.state.assign(value.cpu().numpy())


def _normal(shape: Sequence[int], dtype: Any, seeds: Any, device: Any) -> Any:
    """Returns standard normal draws of `shape`, from both state words.

    Keras' PyTorch draws seed a generator with the sum of the state's two
    words, 32 bits; and PyTorch's CPU generator (MT19937) keeps only 32
    bits of any seed, so one draw of it could be found by trying every
    seed (and a sum of several such draws by trying each one's: each
    correlates with the sum). Here both words (`secret_seeds`: 62 secret
    bits) are hashed (BLAKE2b) into a 128-bit key: on a CUDA device a
    Philox generator seeded with 64 bits of it, on the CPU NumPy's Philox
    keyed with all of it. The state advances by one, as a Keras draw
    advances it.
    """
    words = [int(w) & 0xFFFFFFFF for w in seeds.next().tolist()]
    digest = hashlib.blake2b(struct.pack("<2I", *words), digest_size=16)
    key = int.from_bytes(digest.digest(), "little")
    if device.type == "cuda":
        generator = torch.Generator(device=device)
        generator.manual_seed(key & 0xFFFFFFFFFFFFFFFF)
        return torch.randn(
            tuple(shape), generator=generator, device=device, dtype=dtype
        )
    draws = np.random.Generator(np.random.Philox(key=key)).standard_normal(
        tuple(shape), dtype=np.float32
    )
    return torch.from_numpy(draws).to(device=device, dtype=dtype)


def add_noise(tensors: Sequence[Any], stddev: Any, seeds: Any) -> list[Any]:
    """Returns `tensors` plus normal noise of `stddev`: one draw per dtype.

    Eager PyTorch pays a dispatch (and a reseeded generator) per draw: one
    draw of every entry of a dtype, scaled once, split into views and added
    with one `torch._foreach_add`.
    """
    noisy = list(tensors)
    for indices in _dtype_groups(noisy):
        group = [noisy[i] for i in indices]
        sizes = [t.numel() for t in group]
        flat = (
            _normal((sum(sizes),), group[0].dtype, seeds, group[0].device)
            * stddev
        )
        pieces = [
            piece.view(t.shape)
            for piece, t in zip(torch.split(flat, sizes), group)
        ]
        for i, value in zip(indices, torch._foreach_add(group, pieces)):
            noisy[i] = value
    return noisy


def check_strategy() -> None:
    """Raises for a `keras.distribution` other than data parallelism.

    An initialized `torch.distributed` group is data parallelism over its
    processes (`_torch_processes`), with or without Keras' `DataParallel`.
    Model parallelism (layouts over a mesh, DTensor on PyTorch) has no
    gradient path in custom_fit on PyTorch: refused rather than trained
    unsharded.
    """
    active = keras.distribution.distribution()
    if active is None or isinstance(active, keras.distribution.DataParallel):
        return
    raise ValueError(
        "custom_fit cannot train under model parallelism on PyTorch yet: "
        "its gradients of sharded (DTensor) variables are not built, and "
        "Keras 3.15 trains nothing sharded on PyTorch. Received: "
        f"keras.distribution.distribution()={active!r}. Train data parallel "
        "over torch.distributed processes (no distribution, or "
        "keras.distribution.DataParallel), or use ModelParallel on JAX."
    )


# Whether Keras' PyTorch trainer runs several steps per call (3.16 on).
_SEVERAL_STEPS_PER_CALL = _keras_at_least((3, 16))


def make_step_function(
    model: Any,
    kind: str,
    build_keras_function: Callable[[], Any],
    own_state: Callable[[], list[Any]],
) -> Any:
    """Returns the train or test function, data parallel over processes.

    Keras' own, or with `jit_compile=True` one whose forward pass is
    compiled (`_torch_compile`) rather than the whole step. A call runs the
    batches Keras hands it, one step each: from Keras 3.16 up to
    `steps_per_execution` of them; up to Keras 3.15, whose PyTorch trainer
    refuses more than one, `steps_per_execution` above 1 is refused.
    """
    if model.steps_per_execution > 1 and not _SEVERAL_STEPS_PER_CALL:
        raise ValueError(
            "`steps_per_execution` must be 1 with the PyTorch backend "
            "before Keras 3.16: a call of the train or test function runs "
            "one batch, as in Keras' PyTorch trainer. Received: "
            f"steps_per_execution={model.steps_per_execution} (with "
            f"jit_compile={model.jit_compile!r}). Compile with "
            "steps_per_execution=1."
        )
    if model.jit_compile is True:
        function = _torch_compile.step_function(model, kind)
    else:
        function = build_keras_function()
    return _torch_processes.ProcessStep(model, kind, function, own_state)


def forward(
    model: Any, call: Callable[..., Any], x: Any, training: bool
) -> Any:
    """Returns `call(model, x, training=training)`.

    Under `torch.compile` with `jit_compile=True` (see `_torch_compile`).
    """
    return _torch_compile.forward(model, call, x, training)


class TrainerHooks:
    """No Keras trainer method needs overriding: the step is stateful."""
