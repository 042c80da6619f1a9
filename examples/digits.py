"""Data for the examples: scikit-learn's bundled 8x8 digits, no download."""

from sklearn import datasets
from sklearn import model_selection


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
