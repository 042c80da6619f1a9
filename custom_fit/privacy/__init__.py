"""Private training: DP-SGD inside `fit`, its accountant, and its audit.

The names of `custom_fit.privacy` itself are the accountant's and
DP-SGD's arithmetic (`epsilon`, `calibrate_noise`, `clip_and_sum`,
`add_noise`, ...), defined in `custom_fit.privacy.accounting`. The
package's modules, by concern:

- `privacy_mixin`: `DifferentialPrivacyMixin`, DP-SGD as a step of `fit`
  (its checks of a run before the first step in `_fit_checks`, its
  clipped sums in `_clipped_sums`, what it keeps on the host between
  fits in `_record`);
- `accounting`: clipping, noise, and what a run spends (dp-accounting);
- `per_example`: each example's clipped gradient, vectorized or by ghost
  norms, summed; `ghost` the ghost norms' pure math, `_ghost_layers`
  which Keras layers it covers;
- `sampling`: `PoissonSampler`, the batches the accountant assumes;
- `auditing`: `CanaryAudit`, a lower bound on a run's epsilon from
  canaries (`_canaries` the canaries' rows in a step);
- `_independence`: the check that a model keeps a batch's examples apart.

Their earlier paths (`custom_fit.privacy_mixin`, `custom_fit.per_example`,
`custom_fit.ghost`, `custom_fit.sampling`, `custom_fit.auditing`) name
the same modules.
"""

from custom_fit.privacy import accounting
from custom_fit.privacy.accounting import *  # noqa: F403

__all__ = accounting.__all__
