"""Poisson-sampled batches for private training with `fit`.

DP-SGD's accounting (`custom_fit.privacy.epsilon` with
`sampling="poisson"`) assumes that each step's batch includes every
training example independently with probability `q`: batches of random
size, `Binomial(num_examples, q)`, whose mean is the expected batch size
`q * num_examples`. `fit`'s own batches (the data shuffled, then cut into
batches of a fixed size) are not drawn that way. `PoissonSampler` draws
them that way, for `fit`:

```python
sampler = custom_fit.sampling.PoissonSampler(x, y, batch_size=256, seed=0)
model = Net(inputs, outputs, l2_norm_clip=1.0, noise_multiplier=1.1,
            expected_batch_size=sampler.batch_size)
model.fit(sampler, epochs=20)
```

Over several processes (`torch.distributed`, or JAX under a
`keras.distribution`), every process makes the same sampler (the whole data
set, the same `seed`) and `fit` feeds each process its share of every draw.
"""

import math
import zlib
from typing import Any

import keras
import numpy as np

from custom_fit import _validation
from custom_fit import backend

PAD_AUTO = "auto"


class PoissonSampler(keras.utils.PyDataset):
    """Batches in which each example is included with probability `q`.

    Each batch is drawn anew: every example of `(x, y)` is in it
    independently of the others and of the other batches, with probability
    `q = batch_size / num_examples`. So a batch holds `Binomial(num_examples,
    q)` examples, `batch_size` on average, and may hold none. An epoch is
    `ceil(num_examples / batch_size)` batches, as many as `fit` makes of the
    same data. Each batch is `(x, y, sample_weight)`: the sampled examples
    (in the order of the data), then padding rows.

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
    process, from the whole data set and with the same `seed`. Every
    process then computes the same draw at each step and takes its share
    of it: the drawn examples whose index is `process` modulo the number of
    processes. The shares together are the draw, so each example is in a
    step's global batch with probability `q`, independently, as the
    accountant assumes, and the global expected batch size is `batch_size`
    (the model's `expected_batch_size`). Every share is padded to the same
    number of rows (the largest share, rounded up to `pad_to_multiple_of`),
    as JAX needs. `fit` checks before its first step that the processes'
    samplers agree (data, `seed`, `batch_size`, epoch), and feeds the
    batches in their order (no shuffling), so that every process takes its
    share of the same draw.

    Draws are reproducible: batch `index` of epoch `epoch` depends only on
    `seed`, `epoch` and `index` (`indices(epoch, index)` gives its
    examples), whatever order Keras asks for the batches in. A custom_fit
    model's `fit` asks for them in order unless given `shuffle=True` (the
    batches are independent, so their order changes nothing, and in order
    one process trains on the same batches as several).
    `epoch` counts the sampler's `on_epoch_end` calls (Keras makes one
    before the first epoch too).

    Args:
        x: NumPy array, or a nested structure (list, tuple, dict) of arrays
            with the same first dimension: the training inputs.
        y: Array or nested structure of arrays: the targets.
        batch_size: Integer from 1 to the number of examples. The expected
            batch size; the sampling probability is `batch_size /
            num_examples`.
        sample_weight: Array of one weight per example, or `None`.
        seed: Integer >= 0, or `None` for a seed drawn from the system.
        pad_to_multiple_of: Integer >= 1, or `"auto"` (the default): the
            power of two nearest to `sqrt(batch_size)`, about the standard
            deviation of the batch size. `1` pads only empty batches.
        **kwargs: `workers`, `use_multiprocessing` and `max_queue_size`, as
            `keras.utils.PyDataset` takes them.

    Attributes:
        num_examples: Integer. The number of training examples.
        batch_size: Integer. The expected batch size.
        sampling_rate: Float. The probability `q` of each example.
        epoch: Integer. The epoch whose batches `sampler[index]` is.

    Example:

    ```python
    sampler = custom_fit.sampling.PoissonSampler(x, y, batch_size=64, seed=0)
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._x = keras.tree.map_structure(np.asarray, x)
        self._y = keras.tree.map_structure(np.asarray, y)
        self.num_examples = _common_length(self._x, self._y)
        self.batch_size = _validation.positive_int("batch_size", batch_size)
        if self.batch_size > self.num_examples:
            raise ValueError(
                "`batch_size` is the expected batch size, at most the "
                f"number of examples. Received: batch_size={batch_size} for "
                f"{self.num_examples} examples. Pass a smaller batch_size."
            )
        self._weights = _example_weights(sample_weight, self.num_examples)
        seed = _validation.seed_or_none("seed", seed)
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0])
        self._entropy: int = seed
        self.pad_to_multiple_of = _padding(pad_to_multiple_of, self.batch_size)
        self.sampling_rate = self.batch_size / self.num_examples
        self.epoch = 0
        self._fingerprint = _fingerprint((self._x, self._y, self._weights))
        self._share: tuple[int, int] | None = None

    # How the batches are drawn, which `DifferentialPrivacyMixin.fit` checks
    # against the model and its noise (`custom_fit.privacy.check_run`).
    sampling = "poisson"

    def __len__(self) -> int:
        return math.ceil(self.num_examples / self.batch_size)

    def indices(self, epoch: int, index: int) -> np.ndarray:
        """Returns the examples of one batch (the whole draw), in order.

        Over several processes each process' share of it is the examples
        whose index is the process' index modulo the number of processes.
        Every example is in it independently with probability
        `sampling_rate`: the batch's size is drawn from `Binomial(
        num_examples, sampling_rate)`, then a subset of that size uniformly
        at random (the same distribution).

        Args:
            epoch: Integer >= 0. The epoch, counted over every `fit` on
                this sampler.
            index: Integer >= 0. The batch within the epoch.

        Returns:
            A NumPy array of example indices.
        """
        generator = np.random.default_rng([self._entropy, epoch, index])
        size = generator.binomial(self.num_examples, self.sampling_rate)
        chosen = generator.choice(self.num_examples, size, replace=False)
        return np.sort(chosen)

    def shared_figures(self) -> dict[str, int]:
        """The figures every process' sampler must share, as integers.

        `fit` compares them across processes before its first step: the
        data (a checksum of some of its rows and its shapes), the seed, the
        batch size and the epoch.

        Returns:
            A dict of name to integer in `[0, 2**31)`.
        """
        return {
            "data": self._fingerprint,
            "num_examples": self.num_examples,
            "seed": self._entropy % (2**31 - 1),
            "batch_size": self.batch_size,
            "epoch": self.epoch % (2**31 - 1),
        }

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
        chosen = self.indices(self.epoch, int(index))
        largest = len(chosen)
        processes, process = self._share or backend.current().data_shards()
        if processes > 1:
            owner = chosen % processes
            largest = int(np.bincount(owner, minlength=processes).max())
            chosen = chosen[owner == process]
        multiple = self.pad_to_multiple_of
        rows = max(multiple, -(-largest // multiple) * multiple)
        padding = rows - len(chosen)

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
