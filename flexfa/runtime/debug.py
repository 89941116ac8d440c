"""``FLEXFA_DEBUG=1``: log the IR after each pipeline step and the path of generated sources."""
from __future__ import annotations

import logging
import sys

from .. import config

log = logging.getLogger("flexfa")


def debug_enabled() -> bool:
    return config.debug_enabled()


def debug(step: str, text: str) -> None:
    """Log ``text`` under the heading ``step`` on the ``flexfa`` logger when debugging is on
    (a stderr handler is added if the application configured none)."""
    if not debug_enabled():
        return
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    log.info("[flexfa] %s\n%s", step, text)
