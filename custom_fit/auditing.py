"""The earlier path of `custom_fit.privacy.auditing`.

Importing `custom_fit.auditing` gives that module itself (the same object, so
that patching or reading either path sees one module).
"""

import sys

from custom_fit.privacy import auditing as _module
from custom_fit.privacy.auditing import *  # noqa: F403  (for type checkers)

__all__ = _module.__all__
sys.modules[__name__] = _module
