"""The earlier path of `custom_fit.privacy.privacy_mixin`.

Importing `custom_fit.privacy_mixin` gives that module itself (the same
object, so that patching or reading either path sees one module).
"""

import sys

from custom_fit.privacy import privacy_mixin as _module
from custom_fit.privacy.privacy_mixin import DifferentialPrivacyMixin  # noqa: F401

sys.modules[__name__] = _module
