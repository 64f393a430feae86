"""`module:name` specs (reward functions, tools, environments): one loader, one kind of error.
Standard library only: the tool runner's child process imports it."""

from __future__ import annotations

import importlib
from typing import Any


def load_spec(spec: str, what: str, kind: str = "function") -> Any:
    """The callable `module:name` names; a ValueError naming `what` (e.g. "reward.function")
    when it is not of that form, cannot be imported, raises while importing, or is not
    callable."""
    module, sep, name = spec.partition(":")
    if not sep:
        raise ValueError(f"{what}={spec!r} must be of the form module:{kind}")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}={spec!r} cannot be loaded: {e}") from None
    except Exception as e:  # the module itself raised while it was imported
        raise ValueError(
            f"{what}={spec!r}: importing module {module!r} raised {type(e).__name__}: {e}"
        ) from None
    if not callable(obj):
        raise ValueError(f"{what}={spec!r} is not callable")
    return obj
