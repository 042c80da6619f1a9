"""custom_fit: control over the Keras training step, without leaving `fit`.

Mixins that replace `train_step`/`test_step` with a pipeline of small,
overridable hooks, and the gradient math they use as pure functions.
"""

from custom_fit import accumulation
from custom_fit import auditing
from custom_fit import callbacks
from custom_fit import clipping
from custom_fit import ghost
from custom_fit import inspection
from custom_fit import options
from custom_fit import pcgrad
from custom_fit import per_example
from custom_fit import pipeline
from custom_fit import privacy
from custom_fit import privacy_mixin  # noqa: F401  (its earlier path)
from custom_fit import regularization
from custom_fit import sampling
from custom_fit import sharpness
from custom_fit.clipping_mixin import GradientClippingMixin
from custom_fit.inspection_mixin import GradientInspectionMixin
from custom_fit.multi_optimizer import MultiOptimizer
from custom_fit.pcgrad_mixin import PCGradMixin
from custom_fit.privacy.privacy_mixin import DifferentialPrivacyMixin
from custom_fit.regularization_mixin import RegularizationMixin
from custom_fit.sharpness_mixin import SharpnessAwareMixin
from custom_fit.train_step_mixin import BatchLoss
from custom_fit.train_step_mixin import TrainStepMixin

__version__ = "0.1.0"

__all__ = [
    "BatchLoss",
    "DifferentialPrivacyMixin",
    "GradientClippingMixin",
    "GradientInspectionMixin",
    "MultiOptimizer",
    "PCGradMixin",
    "RegularizationMixin",
    "SharpnessAwareMixin",
    "TrainStepMixin",
    "accumulation",
    "auditing",
    "callbacks",
    "clipping",
    "ghost",
    "inspection",
    "options",
    "pcgrad",
    "per_example",
    "pipeline",
    "privacy",
    "regularization",
    "sampling",
    "sharpness",
]
