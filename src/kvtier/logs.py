"""kvtier's log lines inside an engine that configures only its own logger.

vLLM gives its ``vllm`` logger a handler and leaves the root logger bare, so a record from the
``kvtier`` loggers found no handler there: its INFO lines (the connector's settings, the tiers'
rates, ``kv_codec: auto``'s decisions, a tier falling back to buffered reads) were dropped and
its warnings reached stderr through ``logging.lastResort`` without a level or a time.
``show_in_engine`` gives the ``kvtier`` logger what vLLM gives its own: a level and, when no
handler in the process would print its records, a handler in vLLM's format on vLLM's stream.

Settings, read from the environment:

* ``KVTIER_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR): kvtier's level. Unset: vLLM's
  ``VLLM_LOGGING_LEVEL``, else INFO.
* ``VLLM_CONFIGURE_LOGGING=0`` (vLLM's "I configure logging myself"): kvtier leaves logging
  alone too, unless ``KVTIER_LOG_LEVEL`` is set, which then only sets the level.
* ``VLLM_LOGGING_STREAM`` and ``VLLM_LOGGING_PREFIX``: the handler's stream (``ext://sys.stdout``,
  vLLM's default, or ``ext://sys.stderr``) and the prefix of each line, as vLLM's own.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

LEVEL_ENV = "KVTIER_LOG_LEVEL"
HANDLER_NAME = "kvtier-engine"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMAT = "(%(kvtier_process)s pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
"""vLLM's own format: the process's name as vLLM's lines give it (``EngineCore``, ``Worker``), its pid."""
_DATE_FORMAT = "%m-%d %H:%M:%S"


def show_in_engine(env: Mapping[str, str]) -> logging.Handler | None:
    """Set the ``kvtier`` logger's level, and give it a handler when nothing would print its
    records (neither it nor the root logger has one); returns that handler, or None when none
    was added. Idempotent: a second call (the scheduler and a worker in one process) adds
    nothing. A level the user set on the logger stands unless ``KVTIER_LOG_LEVEL`` is set; an
    unknown level name is reported as a warning and INFO is used."""
    explicit = env.get(LEVEL_ENV, "").strip()
    configure = env.get("VLLM_CONFIGURE_LOGGING", "1").strip() != "0"
    if not configure and not explicit:
        return None
    logger = logging.getLogger("kvtier")
    name = (explicit or env.get("VLLM_LOGGING_LEVEL", "") or "INFO").strip().upper()
    bad = name not in _LEVELS
    if explicit or logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO if bad else name)
    handler: logging.Handler | None = None
    if configure and not logger.handlers and not logging.getLogger().handlers:
        stream = sys.stderr if env.get("VLLM_LOGGING_STREAM", "").strip() == "ext://sys.stderr" else sys.stdout
        handler = logging.StreamHandler(stream)
        handler.name = HANDLER_NAME
        handler.setFormatter(logging.Formatter(env.get("VLLM_LOGGING_PREFIX", "") + _FORMAT, _DATE_FORMAT))
        handler.addFilter(_name_the_process)
        logger.addHandler(handler)
    if bad:
        logger.warning("%s=%r is not a log level (%s): using INFO", LEVEL_ENV if explicit else "VLLM_LOGGING_LEVEL",
                       name, ", ".join(_LEVELS))
    return handler


def _name_the_process(record: logging.LogRecord) -> bool:
    """Name the record's process as vLLM's lines do (vLLM's record factory sets
    ``vllm_process_name``; without it, multiprocessing's name)."""
    record.kvtier_process = getattr(record, "vllm_process_name", None) or record.processName
    return True
