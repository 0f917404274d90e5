"""A script that raises at import."""

import livemig  # noqa: F401

raise RuntimeError("boom at import")
