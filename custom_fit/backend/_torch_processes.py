"""Data parallelism over `torch.distributed` processes, for the PyTorch adapter.

The PyTorch way to train on several devices is one process per device
(`torchrun --nproc_per_node=N train.py`), each fitting its own shard of
every global batch, with a process group that the script initializes
(`torch.distributed.init_process_group`: gloo on CPU, NCCL on CUDA). Keras
3.15 has no PyTorch distribution, and Keras' next release wraps the model
in `DistributedDataParallel`, which reduces only what `loss.backward()`
writes to `.grad`; custom_fit differentiates with `torch.autograd.grad`, so
it reduces its own gradients, here:

- Keras computes each process' loss as the mean over its own examples
  (it does not divide by the number of processes, as it does for
  `tf.distribute` replicas). The gradient of the global batch is the mean
  of the processes' gradients weighted by their batch sizes: one
  all-reduce of one float32 buffer (each gradient times the local batch
  size, then the batch size itself), divided by the summed sizes. An
  uneven last batch is weighted exactly.
- Sums that are sums (DP-SGD's clipped per-example gradients, counts) are
  summed as they are.
- At its first call the train function broadcasts the first process'
  model variables (weights, layer state, seed generators), optimizer
  variables and custom_fit's own state, so processes start equal whatever
  their seeds; from then on every process takes the same decisions from
  the same reduced figures, and draws the same noise.
- Logs are computed from metric states summed over processes (a state
  variable made with `summed=False`, a "last value", is the first
  process'), so every process logs what one process on the global batch
  would.

Nothing here runs, and no collective is issued, unless a process group
of more than one process is initialized.
"""

import contextlib
import threading
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import torch

from custom_fit.backend import _dense
from custom_fit.backend import _writers

_LOCAL = threading.local()
# State variables whose value is the same in every process (a "last
# value"): their logs take the first
# process' value, not the sum (by id: a Keras variable is not hashable).
_NOT_SUMMED: "weakref.WeakValueDictionary[int, Any]" = (
    weakref.WeakValueDictionary()
)


def world_size() -> int:
    """The number of processes of the default group, 1 without one."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_world_size()
    return 1


def _rank() -> int:
    return torch.distributed.get_rank()


def writes_files(model: Any) -> bool:
    """Whether this process writes: alone, or the first of the group."""
    del model
    return world_size() == 1 or _rank() == 0


def mark_not_summed(variable: Any) -> None:
    """Marks a state variable whose logs take the first process' value."""
    _NOT_SUMMED[id(variable)] = variable


def _per_dtype(
    tensors: Sequence[Any], collective: Callable[[Any], None]
) -> list[Any]:
    """Runs `collective` in place on one flat buffer per dtype.

    Returns the tensors' new values, split back out of the buffers (bool
    tensors travel as uint8, which gloo supports).
    """
    results: list[Any] = list(tensors)
    by_dtype: dict[Any, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        if dtype == torch.bool:
            flat = flat.to(torch.uint8)
        collective(flat)
        offset = 0
        for i in indices:
            size = tensors[i].numel()
            value = flat[offset : offset + size].view(tensors[i].shape)
            results[i] = value.to(dtype)
            offset += size
    return results


def _summed(tensors: Sequence[Any]) -> list[Any]:
    """Sums tensors over the processes: one all-reduce per dtype."""
    return _per_dtype(
        tensors,
        lambda flat: torch.distributed.all_reduce(
            flat, op=torch.distributed.ReduceOp.SUM
        ),
    )


def all_reduce_sum(gradients: Sequence[Any]) -> list[Any]:
    """Sums `gradients` (or any tensors) over the processes.

    `None` stays `None`.
    """
    present = [i for i, value in enumerate(gradients) if value is not None]
    result = list(gradients)
    if world_size() == 1 or not present:
        return result
    summed = _summed([gradients[i] for i in present])
    for i, value in zip(present, summed):
        result[i] = value
    return result


def batch_gradients(gradients: Sequence[Any]) -> list[Any]:
    """The global batch's gradients from each process' gradients of its mean.

    Weighted by each process' batch size in float32 (one buffer), then
    cast back to each gradient's dtype.
    """
    present = [i for i, g in enumerate(gradients) if g is not None]
    result = list(gradients)
    world = world_size()
    if world == 1:
        return result
    size = getattr(_LOCAL, "batch_size", None) or 1
    # A fingerprint of the layout (how many gradients exist, how many
    # entries) rides along: it must be the same in every process, or the
    # sums would mix variables. Small numbers (mod 251), so that times a
    # batch size they stay exact in float32.
    entries = sum(gradients[i].numel() for i in present)
    layout = torch.tensor([float(len(present) % 251), float(entries % 251)])
    means = _weighted_means([*(gradients[i] for i in present), layout], size)
    if not torch.allclose(means[-1], layout, rtol=0.0, atol=1e-3):
        raise RuntimeError(
            "The processes' gradients differ in which variables have one "
            "(a branch on the data, or a variable unused by one process' "
            "batch), so they cannot be summed variable by variable. "
            f"Received: {len(present)} gradients of {entries} entries in "
            "this process, and another layout in another. Make every "
            "variable "
            "contribute in every process (a zero-weighted term of its "
            "loss)."
        )
    for i, mean in zip(present, means):
        result[i] = mean
    return result


def _weighted_means(tensors: Sequence[Any], size: int) -> list[Any]:
    """The means of `tensors` over the processes, weighted by `size`.

    One float32 all-reduce of each tensor times `size`, then `size`
    itself; the results are cast back to each tensor's dtype.
    """
    parts = [t.detach().to(torch.float32).reshape(-1) * size for t in tensors]
    weight = torch.tensor([float(size)], device=parts[0].device)
    flat = torch.cat([*parts, weight])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    flat = flat / flat[-1]
    means = []
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        means.append(flat[offset : offset + count].view(tensor.shape))
        means[-1] = means[-1].to(tensor.dtype)
        offset += count
    return means


def summed_count(count: Any) -> Any:
    """`count` summed over the processes (a tensor when reduced)."""
    if world_size() == 1:
        return count
    # float64: counts above 2**24 stay exact (float32 would round them).
    tensor = torch.as_tensor(count, dtype=torch.float64).reshape(1).clone()
    (summed,) = _summed([tensor])
    return summed.reshape(()).to(torch.float32)


def on_first_replica(value: Any) -> Any:
    """`value` in the first process, 0 in the others."""
    if world_size() == 1 or _rank() == 0:
        return value
    return torch.zeros_like(value)  # not `value * 0`: NaN * 0 is NaN


def summed_results(metrics: Sequence[Any], compute: Callable[[], Any]) -> Any:
    """Returns `compute()` run on metric states summed over the processes.

    Over several processes, the variables of `metrics` hold their sums
    while `compute` runs (a variable marked with `mark_not_summed` holds
    the first process' value), its tensors are copied, and the local values
    are written back: each process keeps accumulating its own.
    """
    if world_size() == 1:
        return compute()
    variables = [v for metric in metrics for v in metric.variables]
    if not variables:
        return compute()
    with _summed_values(variables):
        return keras.tree.map_structure(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
            compute(),
        )


@contextlib.contextmanager
def _summed_values(variables: Sequence[Any]) -> Iterator[None]:
    first = _rank() == 0
    local = [variable.value.detach().clone() for variable in variables]
    contributions = [
        value
        if first or _NOT_SUMMED.get(id(variable)) is not variable
        else torch.zeros_like(value)
        for variable, value in zip(variables, local)
    ]
    summed = _summed(
        [
            value.to(torch.float64) if value.is_floating_point() else value
            for value in contributions
        ]
    )
    try:
        for variable, value in zip(variables, summed):
            variable.assign(value.to(variable.value.dtype))
        yield
    finally:
        for variable, value in zip(variables, local):
            variable.assign(value)


class _SamplerEpoch(keras.callbacks.Callback):
    """Gives a sampler each epoch's index before the epoch."""

    def __init__(self, sampler: Any) -> None:
        super().__init__()
        self.sampler = sampler

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        del logs
        self.sampler.set_epoch(epoch)


def fit_callbacks(model: Any, callbacks: list[Any], x: Any) -> list[Any]:
    """Returns the callbacks `fit` runs.

    For a `DataLoader` whose sampler has `set_epoch`, up to Keras 3.15 one
    is added that calls it before each epoch (Keras 3.16's data adapter
    calls it itself): a `DistributedSampler` then shuffles each epoch
    differently, the same way in every process. Over several
    processes, the writing callbacks run in the first only (every process
    holds the same model and logs; reading them is local) and
    `BackupAndRestore` restores in every process (`_writers`).
    """
    del model
    if world_size() > 1:
        callbacks = _writers.written_once(
            callbacks,
            first=_rank() == 0,
            barrier=torch.distributed.barrier,
            everywhere=False,
        )
    sampler = getattr(x, "sampler", None)
    if (
        isinstance(x, torch.utils.data.DataLoader)
        and hasattr(sampler, "set_epoch")
        and not _dense.keras_at_least((3, 16))  # 3.16's adapter calls it
    ):
        callbacks = [*callbacks, _SamplerEpoch(sampler)]
    return callbacks


def data_shards() -> tuple[int, int]:
    """Returns `(processes, rank)` of the default group, `(1, 0)` alone."""
    world = world_size()
    return (world, _rank()) if world > 1 else (1, 0)


def gather_from_processes(values: Sequence[int]) -> Any:
    """Returns every process' `values` as rows of an int64 NumPy array.

    One `all_gather`, on the CUDA device under NCCL (which gathers only
    device tensors), on the CPU otherwise.
    """
    device = torch.device("cpu")
    world = world_size()
    if world > 1 and torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if world == 1:
        return local[None].numpy()
    local = local.to(device)
    rows = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(rows, local)
    return torch.stack(rows).cpu().numpy()


def _batch_size(data: Any) -> int | None:
    """The first axis of the batch's first array, `None` without one."""
    for leaf in keras.tree.flatten(data):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
    return None


def _layer_seed_states(model: Any) -> list[Any]:
    """The seed generator states of the model's layers.

    Generators that the layers own (dropout, noise layers); not those set
    on the model itself (custom_fit's and a user mixin's, such as a
    gradient noise's, which every process must draw alike).
    """
    weights = {id(v) for v in model.weights}
    found: dict[int, Any] = {}
    for layer in getattr(model, "layers", []):
        for variable in layer.variables:
            if (
                id(variable) not in weights
                and variable.name == "seed_generator_state"
            ):
                found.setdefault(id(variable), variable)
    return list(found.values())


def _spread_seeds(states: Sequence[Any]) -> None:
    """Gives the layers' seed generators a seed of this process' own.

    After the broadcast every process holds the first process' generators;
    the model's own random ops (dropout, noise layers) would then draw the
    same masks in every process, so example `i` of each share would get the
    same mask. Each process' seed is the broadcast one mixed with its rank
    (process 0 keeps its own), so the global batch's masks are independent
    as they are in one process. The model's own generators (custom_fit's:
    DP-SGD's noise, PCGrad's order; a user mixin's) are left equal: they
    act on the reduced gradients, which every process must change alike.
    """
    rank = _rank()
    if rank == 0:
        return
    for state in states:
        value = keras.ops.convert_to_numpy(state.value).astype(np.uint64)
        value[0] = (value[0] ^ (rank * 0x9E3779B9)) & 0xFFFFFFFF
        state.assign(value.astype(np.uint32))


def _broadcast(variables: Sequence[Any]) -> None:
    """Gives every process the first process' values of `variables`."""
    values = _per_dtype(
        [variable.value.detach() for variable in variables],
        lambda flat: torch.distributed.broadcast(flat, src=0),
    )
    for variable, value in zip(variables, values):
        variable.assign(value)


class ProcessStep:
    """Keras' PyTorch train or test function, data parallel over processes.

    Without a process group of several processes it calls Keras' function
    as is. With one, the first call broadcasts the first process' state,
    and every call notes the local batch size for `batch_gradients`.

    Args:
        model: The model.
        kind: `"train"` or `"test"`.
        function: Keras' function: `(data) -> logs`.
        own_state: Callable returning custom_fit's own state variables.
    """

    def __init__(
        self,
        model: Any,
        kind: str,
        function: Callable[[Any], Any],
        own_state: Callable[[], list[Any]],
    ) -> None:
        self.model = model
        self.kind = kind
        self.function = function
        self.own_state = own_state
        self.synced = False
        # The float layer state that training moves (found at the first
        # steps: moving statistics, not a frozen layer's weights).
        self.layer_state: list[Any] | None = None
        self.looked = 0

    def __call__(self, data: Any) -> Any:
        if world_size() == 1:
            return self.function(data)
        if not self.synced:
            self.synchronize()
        # Keras hands a call a list of batches (several from Keras 3.16,
        # with `steps_per_execution > 1`): one step each, its size noted.
        logs = None
        for batch in data if isinstance(data, list) else [data]:
            logs = self._one_step([batch])
        return logs

    def _one_step(self, data: list[Any]) -> Any:
        """Runs Keras' function on a list of one batch."""
        size = _batch_size(data)
        looking = self.kind == "train" and self.layer_state is None
        candidates = self.float_state() if looking else []
        before = [v.value.detach().clone() for v in candidates]
        _LOCAL.batch_size = size
        try:
            logs = self.function(data)
        finally:
            _LOCAL.batch_size = None
        if looking:
            self.find_layer_state(candidates, before)
        if self.kind == "train" and self.layer_state:
            self.average_layer_state(size or 1)
        return logs

    def float_state(self) -> list[Any]:
        """The model's float non-trainable variables."""
        return [
            v
            for v in self.model.non_trainable_variables
            if v.value.is_floating_point()
        ]

    def find_layer_state(
        self, candidates: list[Any], before: list[Any]
    ) -> None:
        """Keeps the variables a train step moved in any process.

        Decided (one all-reduce of a mask) at the first step that moved
        one, or after three steps that moved none: a frozen layer's
        weights never move, and are never averaged.
        """
        moved = torch.tensor(
            [
                float(not torch.equal(v.value, b))
                for v, b in zip(candidates, before)
            ]
            or [0.0]
        )
        torch.distributed.all_reduce(moved, op=torch.distributed.ReduceOp.MAX)
        self.looked += 1
        if candidates and bool(moved.any()):
            self.layer_state = [v for v, m in zip(candidates, moved) if m > 0]
        elif self.looked >= 3:
            self.layer_state = []

    def average_layer_state(self, size: int) -> None:
        """Averages the layers' moving state over the processes.

        Each process normalizes by its own batch (no synchronized
        BatchNormalization), so moving statistics differ after a step; they
        are replaced by their mean weighted by batch sizes, so that every
        process holds the same model after every step (and any process'
        checkpoint is the model's).
        """
        variables = self.layer_state or []
        means = _weighted_means([v.value for v in variables], size)
        for variable, mean in zip(variables, means):
            variable.assign(mean)

    def synchronize(self) -> None:
        """Broadcasts the first process' model, optimizer and own state."""
        model = self.model
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        variables += list(self.own_state())
        unique: dict[int, Any] = {}
        for variable in variables:
            unique.setdefault(id(variable), variable)
        _broadcast(list(unique.values()))
        own = {id(v) for v in self.own_state()}
        _spread_seeds(
            [v for v in _layer_seed_states(model) if id(v) not in own]
        )
        self.synced = True
