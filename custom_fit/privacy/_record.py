"""What `DifferentialPrivacyMixin` keeps on the host for one model.

Bookkeeping outside the step (how a fit draws its batches, the passes
begun, what the checks found, the running audit), read by the mixin, its
fit checks, its clipped sums and `callbacks.PrivacyBudget`; what the step
reads and writes is declared state on the mixin.
"""

import dataclasses
from typing import Any

from custom_fit import _model_state


@dataclasses.dataclass
class PrivateRecord:
    """What `DifferentialPrivacyMixin` keeps on the host for one model.

    Attributes:
        run: How the running (or last) fit draws its batches
            (`accounting.TrainingRun`), for its `PrivacyBudget`s.
        passes: The passes over shuffled data that the fits before it
            began.
        noise_drawn: Whether a fit of this model object has drawn from
            the noise's generator (a given `noise_seed` is keyed by where
            the first fit starts: `ResumedRun`).
        probed: Whether `fit` tried the model on a batch
            (`check_examples_apart`).
        ghost_blocker: Why ghost clipping turned out impossible ("": it
            did not), found by the probe or in the traced pass (a loss
            added in a layer's call).
        audit: The running fit's `auditing.CanaryAudit` state
            (`_canaries.Slot`), or `None`.
    """

    run: Any = None
    passes: int = 0
    noise_drawn: bool = False
    probed: bool = False
    ghost_blocker: str = ""
    audit: Any = None


def of(model: Any) -> PrivateRecord:
    """Returns the `PrivateRecord` of `model`, made on first use."""
    return _model_state.record_of(
        model, "DifferentialPrivacyMixin", PrivateRecord
    )
