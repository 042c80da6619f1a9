"""custom_fit: control over the Keras training step, without leaving `fit`.

Mixins that replace `train_step`/`test_step` with a pipeline of small,
overridable hooks, and the gradient math they use as pure functions.
"""

from custom_fit import accumulation
from custom_fit import callbacks
from custom_fit import clipping
from custom_fit import inspection
from custom_fit import pipeline
from custom_fit import regularization
from custom_fit import sharpness
from custom_fit.gradient_clipping import GradientClippingMixin
from custom_fit.gradient_inspection import GradientInspectionMixin
from custom_fit.regularization_mixin import RegularizationMixin
from custom_fit.sharpness_aware import SharpnessAwareMixin
from custom_fit.train_step import TrainStepMixin

__version__ = "0.1.0"

__all__ = [
    "GradientClippingMixin",
    "GradientInspectionMixin",
    "RegularizationMixin",
    "SharpnessAwareMixin",
    "TrainStepMixin",
    "accumulation",
    "callbacks",
    "clipping",
    "inspection",
    "pipeline",
    "regularization",
    "sharpness",
]
