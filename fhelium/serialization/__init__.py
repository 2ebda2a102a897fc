"""Versioned value envelopes and their file/bytes codecs."""

from __future__ import annotations

from fhelium.serialization.codec import *  # noqa: F403
from fhelium.serialization.codec import __all__ as _codec_all
from fhelium.serialization.value import *  # noqa: F403
from fhelium.serialization.value import __all__ as _value_all

# The package's names are its two modules' public ones; each module's `__all__` is the one list of them.
__all__ = [*_codec_all, *_value_all]
