"""Sandboxed pre-warming of spares.

A spare runs K shadow iterations of the user's real loop body (the
`LIVEMIG_SHADOW_STEPS` environment variable, default 2; 0 disables) before it
reports `warm`. Collectives go to a gloo group of one process (a local
HashStore, no peer contacted), with the real shapes and dtypes, which also
initialises the back-end. No state survives: when the spare is claimed the
user's function is entered again and builds model and optimizer anew, and
the streamed state overwrites them.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from livemig.config import ENV_SHADOW_STEPS


def shadow_steps() -> int:
    raw = os.environ.get(ENV_SHADOW_STEPS, "2")
    try:
        k = int(raw)
    except ValueError:
        from livemig.errors import ConfigError

        raise ConfigError(f"{ENV_SHADOW_STEPS}={raw!r} is not an integer") from None
    return max(0, k)


def world_of_one(timeout: timedelta) -> Any:
    """A gloo process group of this process alone (back-end initialised, no peers)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout)
