"""What `fit` can tell of its data before the first step: batch counts.

Arrays are cut by Keras into batches of `batch_size` (32 by default),
after `validation_split` takes its share; a data object with a length
(a `PyDataset`, a `DataLoader`) has that many batches. Anything else
(a generator, a dataset of unknown cardinality) cannot be told.

Where several processes each feed `fit` their share of every global batch,
they compare these counts (and a sampler's figures) before the first step:
a process that runs out of batches first would leave the others waiting in
a collective.
"""

import math
from typing import Any

import keras
import numpy as np

from custom_fit import backend


def is_arrays(x: Any) -> bool:
    """Returns whether `x` is an array or a structure of arrays.

    Data objects (datasets, generators, `PyDataset`s) are not.
    """
    flat = keras.tree.flatten(x) if x is not None else []
    return bool(flat) and all(
        isinstance(item, np.ndarray) or hasattr(item, "__array__")
        for item in flat
    )


def array_examples(x: Any, validation_split: float | None = None) -> int:
    """The examples `fit` trains on from arrays `x`, after the split."""
    examples = int(np.shape(keras.tree.flatten(x)[0])[0])
    if validation_split:
        examples = int(math.floor(examples * (1.0 - validation_split)))
    return examples


def array_batches(examples: int, batch_size: int | None) -> tuple[int, int]:
    """Returns `(batch_size, batches)` of `examples` in Keras' batches.

    Keras' batches hold all the data when the batch size exceeds it.
    """
    size = min(batch_size or 32, examples)
    return size, -(-examples // max(size, 1))


def fit_batches(arguments: dict[str, Any]) -> dict[str, int | None]:
    """The training and validation batches per epoch of `fit`'s arguments.

    Validation is left out when `fit` validates on nothing.
    """
    x = arguments.get("x")
    batch_size = arguments.get("batch_size")
    split = arguments.get("validation_split") or 0.0
    counts = {
        "training": batches_per_epoch(
            x, batch_size, arguments.get("steps_per_epoch"), split
        )
    }
    validation = arguments.get("validation_data")
    validation_batch = arguments.get("validation_batch_size") or batch_size
    steps = arguments.get("validation_steps")
    if validation is not None:
        if isinstance(validation, tuple):
            validation = validation[0]
        counts["validation"] = batches_per_epoch(
            validation, validation_batch, steps
        )
    elif split and is_arrays(x):
        examples = array_examples(x) - array_examples(x, split)
        counts["validation"] = (
            steps or array_batches(examples, validation_batch)[1]
        )
    return counts


def batches_per_epoch(
    x: Any,
    batch_size: int | None = None,
    steps: int | None = None,
    validation_split: float | None = None,
) -> int | None:
    """The batches of one epoch over `x`, or `None` where it cannot be told.

    Args:
        x: `fit`'s (or `evaluate`'s) data.
        batch_size: `fit`'s `batch_size` (arrays only).
        steps: `steps_per_epoch` (or `validation_steps`), which wins.
        validation_split: `fit`'s `validation_split` (arrays only).
    """
    if steps is not None:
        return int(steps)
    if is_arrays(x):
        examples = array_examples(x, validation_split)
        return array_batches(examples, batch_size)[1]
    try:
        return len(x)  # type: ignore[arg-type]
    except TypeError:  # no length (a generator; unknown cardinality)
        return None


def is_sampler(x: Any) -> bool:
    """Whether `x` draws its batches independently of their order.

    True for a `custom_fit.sampling.PoissonSampler` (batch `i` of an epoch
    is its own draw), which the processes share.
    """
    return callable(getattr(x, "shared_figures", None))


def shared_sampler(x: Any) -> bool:
    """Whether `x` is a sampler whose draws several processes share."""
    return is_sampler(x) and backend.current().data_shards()[0] > 1


# What the processes compare before the first step, in a fixed order (every
# process gathers as many values, whatever its data).
_COUNTS = ("training", "validation", "evaluation")
_SAMPLER_FIGURES = ("data", "num_examples", "stream", "batch_size", "epoch")
# The chunks of a sampler's seed (`PoissonSampler.seed_chunks`).
_SEED_CHUNKS = 5


def keras_shards() -> int:
    """The processes Keras deals a `PyDataset`'s batches to; 1 if none.

    Keras 3.16, with the distribution's `auto_shard_dataset` on, gives
    process `p` of `n` batches `p, p + n, p + 2n, ...` of a `PyDataset`
    (before 3.16 it refuses every input but a `tf.data.Dataset` there).
    """
    distribution = keras.distribution.distribution()
    if distribution is None or not getattr(
        distribution, "auto_shard_dataset", False
    ):
        return 1
    # Before 3.16 a sampler never reached Keras' sharding (refused there
    # with Keras' own message): counted by the processes that feed `fit`.
    return max(
        backend.current().data_shards()[0],
        int(getattr(distribution, "num_data_shards", 1)),
    )


def check_keras_shards(x: Any, steps: int | None, name: str) -> None:
    """Raises for data that Keras' sharding would feed wrongly or unevenly.

    Over several processes a step's global batch is every process' batch
    of that step. With Keras' sharding (`keras_shards`), a
    `PoissonSampler`'s shares would come from different draws (two draws
    counted as one), a `PyDataset` whose batches the processes do not
    divide evenly would leave a process waiting in a collective at the
    last step, and a last batch shorter than the first would make a
    global batch of unequal shares (weights and logs silently wrong, each
    process' logs its own). Every batch counts, `steps_per_epoch` or not:
    Keras keeps one iterator over the epochs then, and a later epoch
    reaches the tail. A `PyDataset`'s first and last batches are read here
    for their rows (batches of unequal rows between them are not seen,
    nor a `__getitem__` whose rows vary from call to call). The same
    decision in every process: each holds the whole `PyDataset`. Does
    nothing in one process, or for other data (Keras refuses arrays and
    `DataLoader`s there itself).

    Args:
        x: The data (`fit`'s, its validation data, `evaluate`'s).
        steps: `steps_per_epoch` (or `validation_steps`, `steps`), or
            `None`: it changes nothing (see above).
        name: The data's name in messages (`"training"`, ...).

    Raises:
        ValueError: Naming the setting, what was received and the fix.
    """
    shards = keras_shards()
    if shards == 1 or not isinstance(x, keras.utils.PyDataset):
        return
    distribution = type(keras.distribution.distribution()).__name__
    if is_sampler(x):
        raise ValueError(
            f"A {type(x).__name__} over several processes needs "
            "`auto_shard_dataset = False` on the distribution: each "
            "process feeds its own share of every draw, and Keras' "
            "sharding would deal whole batches of different draws to the "
            "processes, making a step's global batch two draws. Received: "
            f"{distribution} with auto_shard_dataset=True. "
            "Set `distribution.auto_shard_dataset = False` before `fit`."
        )
    del steps  # Keras keeps one iterator over the epochs: every batch runs
    batches = x.num_batches
    if batches is None:
        return  # infinite or unknown: `steps` decides, alike everywhere
    fix = (
        f"Give it a multiple of {shards} batches of equal rows (drop the "
        "short last batch), or set `distribution.auto_shard_dataset = "
        "False` and feed each process its share of every global batch."
    )
    if batches % shards:
        raise ValueError(
            f"Keras deals the {name} PyDataset's batches to the {shards} "
            f"processes in turn, so with {batches} batches process 0 would "
            f"run {-(-batches // shards)} steps and the last "
            f"{batches // shards}, left waiting in a collective. "
            f"Received: {batches} {name} batches, {shards} processes, "
            f"auto_shard_dataset=True. {fix}"
        )
    first, last = _rows(x[0]), _rows(x[batches - 1])
    if first != last:
        raise ValueError(
            f"Keras deals the {name} PyDataset's batches to the {shards} "
            "processes in turn, and a step's global batch joins one batch "
            "of each: its last batch, shorter than the first, would join "
            "shares of unequal rows, which the processes cannot add up "
            f"(weights and logs would be wrong). Received: a first batch "
            f"of {first} rows and a last of {last}, auto_shard_dataset=True. "
            f"{fix}"
        )


def _rows(batch: Any) -> int:
    """The rows of a batch: those of its first array."""
    return int(keras.tree.flatten(batch)[0].shape[0])


def check_processes_agree(
    counts: dict[str, int | None], x: Any, shuffled: bool = False
) -> None:
    """Raises, in every process, unless the processes that feed `fit` agree.

    Does nothing in one process. Otherwise one collective of a fixed
    number of values compares every process' batches per epoch (`counts`),
    whether it feeds a sampler whose draws the processes share, that
    sampler's `shared_figures()`, and whether it asked to shuffle the
    sampler's batches; so that every process raises the same error, none
    is left waiting in a collective.

    Args:
        counts: Dict of data name (`"training"`, `"validation"`,
            `"evaluation"`) to this process' batches per epoch, `None`
            where it cannot be told; a name left out has no data.
        x: `fit`'s (or `evaluate`'s) data.
        shuffled: Bool. Whether `shuffle` was given true with a sampler.

    Raises:
        ValueError: Naming what differs, its range and the fix.
    """
    processes = backend.current().data_shards()[0]
    if processes == 1:
        return
    values = [_coded(counts, n) for n in _COUNTS]
    sampler = shared_sampler(x)
    figures = x.shared_figures() if sampler else {}
    slots = [int(sampler), int(sampler and shuffled)]
    slots += [int(figures.get(n, 0)) for n in _SAMPLER_FIGURES]
    seed = x.seed_chunks() if sampler else [0] * _SEED_CHUNKS
    given = int(sampler and x.seed_given)
    gathered = backend.current().gather_from_processes(
        values + slots + [given, *seed]
    )
    given_at = len(values) + len(slots)
    if sampler and not given:
        # A secret seed: process 0's in every process.
        first = [int(c) for c in gathered[0, given_at + 1 :]]
        x.adopt_seed(first)
    # Each process' seed: its own where given, else process 0's.
    seeds = {
        tuple((row if row[given_at] else gathered[0])[given_at + 1 :])
        for row in gathered
    }
    for i, name in enumerate(_COUNTS):
        least, most = int(gathered[:, i].min()), int(gathered[:, i].max())
        if least != most:
            raise ValueError(_unequal_batches(name, least, most, values[i]))
    offset = len(_COUNTS)
    if gathered[:, offset].min() != gathered[:, offset].max():
        raise ValueError(
            "Every process must fit the same kind of data: a PoissonSampler "
            "in every process, or in none. Received: a PoissonSampler in "
            f"{int(gathered[:, offset].sum())} of {processes} processes. "
            "Make the same sampler in every process."
        )
    if gathered[:, offset + 1].max() > 0:
        raise ValueError(
            "A PoissonSampler shared by several processes is fed in its "
            "order: at every step each process takes its share of the same "
            "draw, and Keras' shuffling (by each process' own random state) "
            "would pair shares of different draws. Its batches are "
            "independent draws, so their order changes nothing. Received: "
            f"a true shuffle in {int(gathered[:, offset + 1].sum())} of "
            f"{processes} processes. Leave shuffle out, or pass "
            "shuffle=False."
        )
    columns = gathered[:, offset + 2 : offset + 2 + len(_SAMPLER_FIGURES)]
    differing = [
        name
        for j, name in enumerate(_SAMPLER_FIGURES)
        if columns[:, j].min() != columns[:, j].max()
    ]
    if gathered[:, given_at].min() != gathered[:, given_at].max():
        raise ValueError(
            f"Every process must make the same {type(x).__name__}: a seed "
            "given in every process, or in none (fit then hands process "
            "0's secret seed to the others). Received: a seed given in "
            f"{int(gathered[:, given_at].sum())} of {processes} processes. "
            "Give the same seed everywhere, or leave it out everywhere."
        )
    if len(seeds) > 1:
        differing.insert(0, "seed")
        figures["seed"] = "given" if given else "secret"
    for name in differing:
        differs = (
            "data (each process holds its own?)"
            if name in ("data", "num_examples")
            else name
        )
        raise ValueError(
            f"Every process must make the same {type(x).__name__}: each "
            "takes its share of the same draw at every step. Received: "
            f"samplers whose {differs} differ across {processes} processes "
            f"({name} in this process: {figures[name]}). Pass every process "
            "the whole data set, the same batch_size and the same seed (or "
            "none in every process: fit hands process 0's secret seed to "
            "the others), and fit it as often in every process."
        )


def _coded(counts: dict[str, int | None], name: str) -> int:
    """A batch count as gathered: none 0, unknown 1, n batches n + 2."""
    if name not in counts:
        return 0
    count = counts[name]
    return 1 if count is None else int(count) + 2


def _unequal_batches(name: str, least: int, most: int, mine: int) -> str:
    """The message for batch counts that differ across processes."""

    def shown(code: int) -> str:
        return {0: "no", 1: "an unknown number of"}.get(code, str(code - 2))

    return (
        f"Every process must run as many {name} batches per epoch: a "
        "process that runs out first leaves the others waiting in a "
        f"collective. Received: from {shown(least)} to {shown(most)} {name} "
        f"batches per epoch across the processes (this process: "
        f"{shown(mine)}). Give each process an equal share (a "
        "DistributedSampler pads the shares to equal sizes; arrays sliced "
        "as x[rank::world] need as many batches in every slice), or set "
        "the same steps_per_epoch in every process."
    )
