"""Poisson-sampled batches for private training with `fit`.

DP-SGD's accounting (`custom_fit.privacy.epsilon` with
`sampling="poisson"`) assumes that each step's batch includes every
training example independently with probability `q`: batches of random
size, `Binomial(num_examples, q)`, whose mean is the expected batch size
`q * num_examples`. `fit`'s own batches (the data shuffled, then cut into
batches of a fixed size) are not drawn that way. `PoissonSampler` draws
them that way, for `fit`:

```python
sampler = custom_fit.sampling.PoissonSampler(x, y, batch_size=256)
model = Net(inputs, outputs, l2_norm_clip=1.0, noise_multiplier=1.1,
            expected_batch_size=sampler.batch_size)
model.fit(sampler, epochs=20)
```

The draws are the privacy: whoever knows the seed can list every batch,
and the accountant's amplification by sampling is gone. So the seed is
drawn from the operating system's entropy unless one is passed (a
reproducible run, for tests; with a warning), and never saved.

Over several processes (`torch.distributed`, or JAX under a
`keras.distribution`), every process makes the same sampler (the whole data
set) and `fit` feeds each process its share of every draw; a secret seed is
process 0's, which `fit` hands to the others before the first step.
"""

import math
import warnings
import zlib
from typing import Any

import keras
import numpy as np

from custom_fit import _validation
from custom_fit import backend

__all__ = [
    "PAD_AUTO",
    "PoissonSampler",
]


PAD_AUTO = "auto"
# A secret seed's bits, and the chunks in which processes exchange it
# (`gather_from_processes` carries integers below 2**31).
_SEED_BITS = 128
_CHUNK_BITS = 30


class PoissonSampler(keras.utils.PyDataset):
    """Batches in which each example is included with probability `q`.

    Each batch is drawn anew: every example of `(x, y)` is in it
    independently of the others and of the other batches, with probability
    `q = batch_size / num_examples`. So a batch holds `Binomial(num_examples,
    q)` examples, `batch_size` on average, and may hold none. An epoch is
    `ceil(num_examples / batch_size)` batches, as many as `fit` makes of the
    same data. Each batch is `(x, y, sample_weight)`: the sampled examples
    (in the order of the data), then padding rows.

    Gradient accumulation: with `gradient_accumulation_steps=k` (the
    model's), each update's logical batch is one draw at the rate `q = k *
    batch_size / num_examples`, served as `k` consecutive batches (the
    draw's examples dealt out in turn), so that an example is in an update
    at most once, and an update is one Poisson draw, as the accountant
    counts it. An epoch is then `k * ceil(num_examples / (k * batch_size))`
    batches, a whole number of updates; the model's `expected_batch_size`
    is the logical batch's, `k * batch_size`. A private model with
    accumulation refuses a sampler that does not split its draws so.

    Padding: `jax.jit` and XLA compile a step once per batch shape, and
    Poisson batches have many sizes (about `batch_size +- 4 *
    sqrt(batch_size)`). Each batch is therefore padded, with rows of zeros
    whose sample weight is 0, up to a multiple of `pad_to_multiple_of`
    (and to at least one row, for an empty batch), so that a run compiles
    the step a few times only (about `8 * sqrt(batch_size) /
    pad_to_multiple_of` shapes). The sampling stays exactly Poisson (no
    batch is cut), and a row of weight 0 has no effect on a private step
    that divides by the expected batch size
    (`DifferentialPrivacyMixin(expected_batch_size=...)`, which the model
    must then have): the mixin leaves such a row out. It does count in
    Keras' logged loss, which divides the weighted sum of a batch's losses
    by its number of rows: the logged loss is that of the batch's examples
    times their share of the rows.
    Metrics with sample weights (accuracy) leave the padding out.

    Several processes: where `fit`'s input is split across processes
    (`torch.distributed` processes, each fitting its own share; JAX
    processes under a `keras.distribution`), make the same sampler in every
    process, from the whole data set. Every process then computes the same
    draw at each step and takes its share of it: the drawn examples whose
    index is `process` modulo the number of processes. The shares together
    are the draw, so each example is in a step's global batch with
    probability `q`, independently, as the accountant assumes, and the
    global expected batch size is `batch_size` (the model's
    `expected_batch_size`). Every share is padded to the same number of
    rows (the largest share, rounded up to `pad_to_multiple_of`), as JAX
    needs. A secret seed (the default) is process 0's: `fit` hands it to
    the others before its first step. `fit` then checks that the
    processes' samplers agree (data, seed, `batch_size`, epoch), and feeds
    the batches in their order (no shuffling), so that every process takes
    its share of the same draw.

    The seed: batch `index` of epoch `epoch` depends only on the seed,
    `epoch` and `index` (`indices(epoch, index)` gives its examples),
    whatever order Keras asks for the batches in. Whoever knows the seed
    can list every batch, which takes away the amplification by sampling
    that the accountant counts: leave `seed` out (128 bits drawn from the
    operating system, never saved) unless a run must be reproducible, and
    then keep the seed as secret as the data (passing one warns). A sampler
    with a seed that a private model trains draws from a stream keyed with
    where the run starts (the model's updates and weights: `continue_after`),
    so that a run that continues an earlier one (a model loaded, or
    restored by `BackupAndRestore`) draws none of its batches again.
    A custom_fit model's `fit` asks for the batches in order unless given
    `shuffle=True` (the batches are independent, so their order changes
    nothing, and in order one process trains on the same batches as
    several). `epoch` counts the sampler's `on_epoch_end` calls (Keras makes
    one before the first epoch too).

    Args:
        x: NumPy array, or a nested structure (list, tuple, dict) of arrays
            with the same first dimension: the training inputs.
        y: Array or nested structure of arrays: the targets.
        batch_size: Integer from 1 to the number of examples. The expected
            size of each batch; with `gradient_accumulation_steps=k`, that
            of each of an update's `k` batches.
        sample_weight: Array of one weight per example, or `None`.
        seed: Integer >= 0, or `None` (the default) for a secret seed
            drawn from the operating system.
        pad_to_multiple_of: Integer >= 1, or `"auto"` (the default): the
            power of two nearest to `sqrt(batch_size)`, about the standard
            deviation of the batch size. `1` pads only empty batches.
        gradient_accumulation_steps: Integer >= 1. The batches of one
            update (the model's `gradient_accumulation_steps`): each draw is
            served as that many batches. Defaults to 1.
        **kwargs: `workers`, `use_multiprocessing` and `max_queue_size`, as
            `keras.utils.PyDataset` takes them.

    Attributes:
        num_examples: Integer. The number of training examples.
        batch_size: Integer. The expected batch size.
        gradient_accumulation_steps: Integer. The batches of one draw.
        sampling_rate: Float. The probability `q` of each example in each
            draw (each update).
        epoch: Integer. The epoch whose batches `sampler[index]` is.
        seed_given: Bool. Whether a seed was passed (a reproducible run).

    Example:

    ```python
    sampler = custom_fit.sampling.PoissonSampler(x, y, batch_size=64)
    model = Net(inputs, outputs, l2_norm_clip=1.0, noise_multiplier=1.1,
                expected_batch_size=sampler.batch_size)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(sampler, epochs=3)  # no batch_size: the sampler batches
    ```
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        batch_size: int,
        sample_weight: Any = None,
        seed: int | None = None,
        pad_to_multiple_of: int | str = PAD_AUTO,
        gradient_accumulation_steps: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._x = keras.tree.map_structure(np.asarray, x)
        self._y = keras.tree.map_structure(np.asarray, y)
        self.num_examples = _common_length(self._x, self._y)
        self.batch_size = _validation.positive_int("batch_size", batch_size)
        steps = _validation.positive_int(
            "gradient_accumulation_steps", gradient_accumulation_steps
        )
        self.gradient_accumulation_steps = steps
        if self.batch_size * steps > self.num_examples:
            raise ValueError(
                "`batch_size` is the expected batch size (times "
                "`gradient_accumulation_steps`, the expected size of a "
                "draw), at most the number of examples. Received: "
                f"batch_size={batch_size}, gradient_accumulation_steps="
                f"{steps} for {self.num_examples} examples. Pass a smaller "
                "batch_size."
            )
        self._weights = _example_weights(sample_weight, self.num_examples)
        seed = _validation.seed_or_none("seed", seed)
        self.seed_given = seed is not None
        if seed is None:
            seed = secret_seed()
        else:
            warnings.warn(
                f"PoissonSampler(seed={seed}) makes every batch "
                "reproducible: whoever knows the seed can list which examples "
                "each step trained on, and the privacy amplification by "
                "sampling that the accountant counts is gone. Keep the seed "
                "as secret as the data, or leave it out (a secret one is "
                "drawn from the operating system).",
                UserWarning,
                stacklevel=2,
            )
        self._entropy: int = seed
        # Nonzero once the stream continues a run of `_stream` updates.
        self._stream = 0
        self.pad_to_multiple_of = _padding(pad_to_multiple_of, self.batch_size)
        self.sampling_rate = self.batch_size * steps / self.num_examples
        self.epoch = 0
        self._fingerprint = _fingerprint((self._x, self._y, self._weights))
        self._share: tuple[int, int] | None = None

    # How the batches are drawn, which `DifferentialPrivacyMixin.fit` checks
    # against the model and its noise (`accounting.check_run`).
    sampling = "poisson"

    def __len__(self) -> int:
        steps = self.gradient_accumulation_steps
        draws = math.ceil(self.num_examples / (self.batch_size * steps))
        return draws * steps

    def draw(self, epoch: int, number: int) -> np.ndarray:
        """Returns the examples of one draw (one update's), in order.

        Every example is in it independently with probability
        `sampling_rate`: the draw's size is drawn from `Binomial(
        num_examples, sampling_rate)`, then a subset of that size uniformly
        at random (the same distribution).

        Args:
            epoch: Integer >= 0. The epoch, counted over every `fit` on
                this sampler.
            number: Integer >= 0. The draw within the epoch (batch `index`
                is of draw `index // gradient_accumulation_steps`).

        Returns:
            A NumPy array of example indices.
        """
        return self._drawn(epoch, number, self.num_examples)

    def _drawn(self, epoch: int, number: int, population: int) -> np.ndarray:
        """`draw` from `population` indices (an audit adds its canaries)."""
        key = [self._entropy, epoch, number]
        if self._stream:
            key = [self._entropy, self._stream, epoch, number]
        generator = np.random.default_rng(key)
        size = generator.binomial(population, self.sampling_rate)
        chosen = generator.choice(population, size, replace=False)
        return np.sort(chosen)

    def indices(self, epoch: int, index: int) -> np.ndarray:
        """Returns the examples of one batch (over processes, all shares).

        Without accumulation the batch is a whole draw (`draw(epoch,
        index)`); with `gradient_accumulation_steps=k` it is the `index %
        k`-th of the `k` parts into which draw `index // k` is dealt (its
        examples in turn). Over several processes each process' share of
        it is the examples whose index is the process' index modulo the
        number of processes.

        Args:
            epoch: Integer >= 0. The epoch, counted over every `fit` on
                this sampler.
            index: Integer >= 0. The batch within the epoch.

        Returns:
            A NumPy array of example indices, in order.
        """
        return self._parts(epoch, index)[
            index % self.gradient_accumulation_steps
        ]

    def _parts(self, epoch: int, index: int) -> list[np.ndarray]:
        """The batches of the draw that batch `index` belongs to."""
        steps = self.gradient_accumulation_steps
        chosen = self.draw(epoch, index // steps)
        return [chosen[part::steps] for part in range(steps)]

    def shared_figures(self) -> dict[str, int]:
        """The figures every process' sampler must share, as integers.

        `fit` compares them across processes before its first step, with
        the seed (`seed_chunks`): the data (a checksum of some of its rows
        and its shapes), the stream, the batch size of a draw and the
        epoch.

        Returns:
            A dict of name to integer in `[0, 2**31)`.
        """
        return {
            "data": self._fingerprint,
            "num_examples": self.num_examples,
            "stream": self._stream % (2**31 - 1),
            "batch_size": self.batch_size * self.gradient_accumulation_steps,
            "epoch": self.epoch % (2**31 - 1),
        }

    def seed_chunks(self) -> list[int]:
        """The seed, as integers in `[0, 2**30)` that processes exchange.

        `fit` gathers them with its other checks before the first step;
        where the seed is secret (not given), every process then takes
        process 0's (`adopt_seed`).

        Returns:
            A list of integers, as long for every seed.
        """
        return _chunks(self._entropy)

    def adopt_seed(self, chunks: list[int]) -> None:
        """Takes the seed another process' `seed_chunks` gave.

        Args:
            chunks: What `seed_chunks` returned in that process.
        """
        self._entropy = _joined([int(c) for c in chunks])

    def continue_after(self, start: int) -> None:
        """Keys the draws with where the run starts.

        A private model's `fit` calls it for a sampler with a given seed
        that has trained no epoch, with a key of the model's update count
        and weights (`custom_fit.privacy.accounting.stream_key`): the same
        start draws the same batches (a reproducible run), and a run that
        continues an earlier one (a loaded model, `BackupAndRestore`) none
        of the earlier run's.

        Args:
            start: Integer >= 1. The key of the run's start.
        """
        self._stream = int(start)

    def use_share(self, processes: int, index: int) -> None:
        """Fixes the share this process feeds: `index` of `processes`.

        `fit` calls it in its own thread before training: batches may be
        made in worker threads or processes, which cannot tell the
        processes themselves (a `keras.distribution` is per thread).
        Without it, each batch asks the backend.

        Args:
            processes: Integer >= 1. The processes that split each draw.
            index: Integer in `[0, processes)`. This process' share.
        """
        self._share = (int(processes), int(index))

    def __getitem__(self, index: int) -> tuple[Any, Any, np.ndarray]:
        index = int(index)
        parts = self._parts(self.epoch, index)
        chosen = parts[index % self.gradient_accumulation_steps]
        largest = max(len(part) for part in parts)
        processes, process = self._share or backend.current().data_shards()
        if processes > 1:
            largest = max(
                int(np.bincount(part % processes, minlength=processes).max())
                for part in parts
            )
            chosen = chosen[chosen % processes == process]
        multiple = self.pad_to_multiple_of
        rows = max(multiple, -(-largest // multiple) * multiple)
        return self._rows(chosen, rows - len(chosen))

    def _rows(
        self, chosen: np.ndarray, padding: int
    ) -> tuple[Any, Any, np.ndarray]:
        """The batch of examples `chosen`, then `padding` rows of zeros."""

        def take(array: np.ndarray) -> np.ndarray:
            taken = array[chosen]
            zeros = np.zeros((padding,) + array.shape[1:], array.dtype)
            return np.concatenate([taken, zeros])

        x = keras.tree.map_structure(take, self._x)
        y = keras.tree.map_structure(take, self._y)
        return x, y, take(self._weights)

    def on_epoch_end(self) -> None:
        """Moves to the next epoch's draws."""
        self.epoch += 1


def secret_seed() -> int:
    """Returns a seed of 128 bits from the operating system's entropy.

    Returns:
        A non-negative Python integer.
    """
    entropy: Any = np.random.SeedSequence().entropy
    return int(entropy) % (1 << _SEED_BITS)


def _chunks(value: int) -> list[int]:
    """Splits a secret seed into integers below `2**_CHUNK_BITS`."""
    count = -(-_SEED_BITS // _CHUNK_BITS)
    mask = (1 << _CHUNK_BITS) - 1
    return [(value >> (_CHUNK_BITS * i)) & mask for i in range(count)]


def _joined(chunks: list[int]) -> int:
    """The seed `_chunks` split."""
    return sum(c << (_CHUNK_BITS * i) for i, c in enumerate(chunks))


def _fingerprint(arrays: Any) -> int:
    """A CRC-32 of the shapes and of up to 64 rows spread over the data.

    Rows of Python objects (text) are hashed by their values' `repr`, not
    by their addresses.
    """
    checksum = 0
    for array in keras.tree.flatten(arrays):
        rows = np.unique(np.linspace(0, len(array) - 1, 64).astype(int))
        checksum = zlib.crc32(repr(array.shape).encode(), checksum)
        picked = array[rows]
        if picked.dtype == object:
            data = repr(picked.tolist()).encode()
        else:
            data = picked.tobytes()
        checksum = zlib.crc32(data, checksum)
    return checksum % (2**31 - 1)


def _common_length(x: Any, y: Any) -> int:
    """Returns the first dimension shared by every array of `x` and `y`."""
    lengths = {
        int(array.shape[0]) if array.ndim else 0
        for array in keras.tree.flatten((x, y))
    }
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            "`x` and `y` must be arrays (or nested structures of arrays) "
            "with the same, non-zero first dimension: the examples. "
            f"Received: first dimensions {sorted(lengths)} (0: a scalar). "
            "Pass one row per example in every array."
        )
    return lengths.pop()


def _example_weights(sample_weight: Any, num_examples: int) -> np.ndarray:
    """Returns one float32 weight per example (ones without weights)."""
    if sample_weight is None:
        return np.ones(num_examples, "float32")
    weights = np.asarray(sample_weight, "float32")
    if weights.shape != (num_examples,):
        raise ValueError(
            "`sample_weight` must hold one weight per example. Received: "
            f"sample_weight of shape {weights.shape} for {num_examples} "
            "examples. Pass a vector of length num_examples."
        )
    return weights


def _padding(value: Any, batch_size: int) -> int:
    """Validates `pad_to_multiple_of`; resolves `"auto"`."""
    if value == PAD_AUTO and isinstance(value, str):
        return 2 ** round(math.log2(math.sqrt(batch_size)))
    return _validation.positive_int("pad_to_multiple_of", value, 'or "auto"')
