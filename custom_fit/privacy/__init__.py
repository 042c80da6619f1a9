"""Differential privacy: per-example clipping, noise, and the accountant.

DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy")
bounds each example's influence on an update: the gradient of every
microbatch (one example, or a group of consecutive examples) is clipped to
an L2 norm of `l2_norm_clip` over all trainable variables, the clipped
gradients are summed, Gaussian noise of standard deviation
`noise_multiplier * l2_norm_clip` is added once per coordinate, and the
sum is divided by the number of microbatches (TensorFlow Privacy's
convention). `DifferentialPrivacyMixin` runs this inside `fit`; these are
its pure parts, and the accountant that says what a run spends:

```python
epsilon = custom_fit.privacy.epsilon(
    steps=60 * 60000 // 256, batch_size=256, num_examples=60000,
    noise_multiplier=1.1, delta=1e-5,
)
```

The package holds the rest of private training beside them:
`custom_fit.sampling` (`PoissonSampler`), `custom_fit.auditing`
(`CanaryAudit`), `custom_fit.per_example` and `custom_fit.ghost` (each
example's clipped gradient), and the mixin (`custom_fit.privacy_mixin`);
those paths name the package's modules (`custom_fit.privacy.sampling`,
...). The names above are defined in `custom_fit.privacy.accounting`.
"""

from typing import Any

from custom_fit.privacy import accounting
from custom_fit.privacy.accounting import *  # noqa: F403

__all__ = accounting.__all__


def __getattr__(name: str) -> Any:
    """The accountant's other names, read as before the package existed.

    `custom_fit.privacy.TrainingRun` and the like (helpers, never public;
    and what pickles of a `CalibratedNoise` name) come from
    `custom_fit.privacy.accounting`. Patch them there: the package's
    names are references to that module's.
    """
    try:
        return getattr(accounting, name)
    except AttributeError:
        raise AttributeError(
            f"module 'custom_fit.privacy' has no attribute {name!r}"
        ) from None
