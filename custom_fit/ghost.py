"""The earlier path of `custom_fit.privacy.ghost`.

Importing `custom_fit.ghost` gives that module itself (the same object, so
that patching or reading either path sees one module).
"""

import sys

from custom_fit.privacy import ghost as _module
from custom_fit.privacy.ghost import *  # noqa: F403  (for type checkers)

__all__ = _module.__all__
sys.modules[__name__] = _module
