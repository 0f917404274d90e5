"""livemig: live-migration recovery with hot spares for PyTorch training.

The top level imports lazily so that light processes (the etcd guard, the
CLI's `status`) do not pay for `import torch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from livemig.api import Context, elastic
    from livemig.data import batch_generator
    from livemig.runtime.strategies import Replicated, Strategy

__all__ = ["Context", "Replicated", "Strategy", "elastic", "batch_generator", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Context", "elastic"):
        from livemig import api

        return getattr(api, name)
    if name in ("Strategy", "Replicated"):  # ctx.register(strategy=...): a kind of parallelism of one's own
        from livemig.runtime import strategies

        return getattr(strategies, name)
    if name == "batch_generator":
        from livemig.data import batch_generator

        return batch_generator
    raise AttributeError(f"module 'livemig' has no attribute {name!r}")
