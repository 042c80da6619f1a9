"""The earlier path of `custom_fit.privacy.sampling`.

Importing `custom_fit.sampling` gives that module itself (the same object, so
that patching or reading either path sees one module).
"""

import sys

from custom_fit.privacy import sampling as _module
from custom_fit.privacy.sampling import *  # noqa: F403  (for type checkers)

__all__ = _module.__all__
sys.modules[__name__] = _module
