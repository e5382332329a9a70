"""The ``zengine`` logger: INFO to stderr with a short prefix, unless the application configured logging."""

import logging

logger = logging.getLogger("zengine")


def setup_logging() -> logging.Logger:
    """Give the zengine logger a handler once, if neither it nor the root logger has one."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[zengine] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
