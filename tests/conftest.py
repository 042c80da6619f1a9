"""Test session set-up per Keras backend: two devices, markers, quiet logs.

The suite runs once per backend (`KERAS_BACKEND=tensorflow`, then `jax`;
see `.ci/run`). Tests about one backend only are marked `tensorflow` or
`jax` and skipped on the other.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
BACKEND = os.environ.setdefault("KERAS_BACKEND", "tensorflow")

if BACKEND == "jax":
    # DataParallel tests need two devices; JAX reads this at start-up.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=2"
    ).strip()
else:
    import tensorflow as tf

    # MirroredStrategy tests need two devices; they must exist before
    # TensorFlow initialises its runtime, so this runs at collection time.
    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0],
        [tf.config.LogicalDeviceConfiguration()] * 2,
    )
    tf.config.experimental.enable_tensor_float_32_execution(False)

_BACKEND_MARKERS = ("tensorflow", "jax")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    for name in _BACKEND_MARKERS:
        config.addinivalue_line(
            "markers", f"{name}: runs only with KERAS_BACKEND={name}"
        )


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        for name in _BACKEND_MARKERS:
            if name != BACKEND and item.get_closest_marker(name):
                item.add_marker(
                    pytest.mark.skip(reason=f"needs KERAS_BACKEND={name}")
                )
