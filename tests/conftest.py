"""Test session set-up: two logical CPUs, no TF32, quiet logs, markers."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

# MirroredStrategy tests need two devices; they must exist before TensorFlow
# initialises its runtime, so this runs at collection time.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)
tf.config.experimental.enable_tensor_float_32_execution(False)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
