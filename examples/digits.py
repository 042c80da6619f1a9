"""Data for the examples: scikit-learn's bundled digits, or MNIST.

The default, `digits`, is the 8x8 digits that ship with scikit-learn (1,797
images, no download). `mnist` is `keras.datasets.mnist` (28x28, downloaded
once into `$KERAS_HOME/datasets`, by default `~/.keras/datasets`), for
when the network is there.
"""

import os
import sys

import keras
import numpy as np
from sklearn import datasets
from sklearn import model_selection

DATASETS = ("digits", "mnist")


def load_digits(seed=0, validation_fraction=0.2):
    """Returns `(x_train, y_train), (x_val, y_val)` with pixels in [0, 1].

    Args:
        seed: Integer. Seed of the train/validation split.
        validation_fraction: Float. Share of the 1,797 images held out.

    Returns:
        Two `(x, y)` pairs: float32 arrays of shape `(n, 64)` and integer
        labels 0-9.
    """
    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_val, y_train, y_val = model_selection.train_test_split(
        x, digits.target, test_size=validation_fraction, random_state=seed
    )
    return (x_train, y_train), (x_val, y_val)


def local_share(x, y, process, processes, global_batch):
    """Returns one process's rows of every full global batch.

    Processes that each feed their rows train on the global batches of one
    process fed `x` and `y` unshuffled, in batches of `global_batch`.

    Args:
        x: Array of all samples.
        y: Array of all labels.
        process: Integer, this process's index.
        processes: Integer, the number of processes.
        global_batch: Integer, the global batch size.

    Returns:
        `(x, y)` of this process: for each full global batch, its rows
        `[process * share, (process + 1) * share)`, `share` being
        `global_batch / processes`.
    """
    share = global_batch // processes
    batches = len(x) // global_batch
    keep = [
        row
        for batch in range(batches)
        for row in range(
            batch * global_batch + process * share,
            batch * global_batch + (process + 1) * share,
        )
    ]
    return x[keep], y[keep]


def keras_datasets_dir():
    """Returns the directory Keras downloads datasets into.

    `$KERAS_HOME/datasets` if `KERAS_HOME` is set, else
    `~/.keras/datasets`; `/tmp/.keras/datasets` if that home is not
    writable, as `keras.utils.get_file` falls back.
    """
    home = os.path.expanduser(os.environ.get("KERAS_HOME", "~/.keras"))
    if not os.access(home, os.W_OK):
        home = os.path.join("/tmp", ".keras")
    return os.path.join(home, "datasets")


def load_mnist():
    """Returns MNIST as `load_digits` does, images flattened to 784.

    Exits the program with a message naming the fix when MNIST is neither
    cached nor downloadable.
    """
    try:
        (x_train, y_train), (x_val, y_val) = keras.datasets.mnist.load_data()
    except Exception as error:  # noqa: BLE001  (any download failure)
        sys.exit(
            "error: --dataset=mnist could not load MNIST: keras.datasets."
            f"mnist.load_data() failed with {type(error).__name__}: {error}. "
            f"It downloads the data once into {keras_datasets_dir()}, which "
            "needs network access. Run with --dataset=digits (bundled with "
            "scikit-learn, no download) instead."
        )

    def flat(images):
        return (images.reshape(len(images), -1) / 255.0).astype("float32")

    return (flat(x_train), y_train), (flat(x_val), y_val)


def load_dataset(name, seed=0):
    """Returns the named dataset, as `load_digits` does.

    Args:
        name: `"digits"` or `"mnist"`.
        seed: Integer. Seed of the digits train/validation split.

    Returns:
        `(x_train, y_train), (x_val, y_val)`, pixels in [0, 1].
    """
    if name == "mnist":
        return load_mnist()
    if name == "digits":
        return load_digits(seed)
    raise ValueError(
        f"Unknown dataset. Received: dataset={name!r}. Use one of {DATASETS}."
    )


def image_side(features):
    """Returns the side of the square images with `features` pixels."""
    return int(round(np.sqrt(features)))
