"""``kvtier.logs.show_in_engine``: kvtier's records reach a handler inside an engine that
configures only its own logger (vLLM), at the level asked, without doubling anyone's output."""

from __future__ import annotations

import io
import logging
import os
import sys

import pytest

from kvtier.logs import HANDLER_NAME, show_in_engine


@pytest.fixture
def bare_process() -> logging.Logger:
    """The logging state of a vLLM engine process: the ``kvtier`` logger has neither level nor
    handler (conftest's autouse fixture puts both back afterwards). The tests take pytest's
    handlers off the root logger themselves (``bare_root``): pytest adds them after the
    fixtures ran."""
    kvtier = logging.getLogger("kvtier")
    kvtier.handlers = []
    kvtier.setLevel(logging.NOTSET)
    return kvtier


def bare_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """The root logger of a vLLM engine process: no handlers."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_an_info_line_of_kvtier_is_printed_in_vllms_format_on_vllms_stream(
        bare_process: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    bare_root(monkeypatch)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    handler = show_in_engine({})
    assert handler is not None and handler.name == HANDLER_NAME
    logging.getLogger("kvtier.tiers.files").info("O_DIRECT not supported under %s", "/pool")
    logging.getLogger("kvtier.reader").debug("not at INFO")
    line = out.getvalue()
    assert line.startswith(f"(MainProcess pid={os.getpid()}) INFO ") and "[test_logs.py:" in line
    assert line.rstrip().endswith("not supported under /pool")
    assert "not at INFO" not in line
    assert show_in_engine({}) is None and len(bare_process.handlers) == 1  # the second role adds nothing


def test_the_level_follows_kvtier_then_vllm_and_a_bad_name_is_reported(
        bare_process: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    bare_root(monkeypatch)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    show_in_engine({"VLLM_LOGGING_LEVEL": "DEBUG", "KVTIER_LOG_LEVEL": "warning",
                    "VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_PREFIX": "[node3] "})
    assert bare_process.level == logging.WARNING
    logging.getLogger("kvtier.x").info("hidden")
    logging.getLogger("kvtier.x").warning("shown")
    text = err.getvalue()
    assert text.startswith("[node3] (MainProcess pid=") and " WARNING " in text and "hidden" not in text

    show_in_engine({"VLLM_LOGGING_LEVEL": "DEBUG"})  # a level already set stands without KVTIER_LOG_LEVEL
    assert bare_process.level == logging.WARNING
    show_in_engine({"KVTIER_LOG_LEVEL": "loud"})
    assert bare_process.level == logging.INFO
    assert "KVTIER_LOG_LEVEL='LOUD' is not a log level" in err.getvalue()


def test_a_process_whose_logging_is_configured_gets_a_level_but_no_second_handler(
        bare_process: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    monkeypatch.setattr(logging.getLogger(), "handlers", [Keep()])  # the user's basicConfig
    assert show_in_engine({}) is None
    logging.getLogger("kvtier.codec.rates").info("decision")
    assert [r.getMessage() for r in seen] == ["decision"]  # printed once, by the user's handler


def test_vllm_configure_logging_0_leaves_logging_alone_unless_kvtier_asks(
        bare_process: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    bare_root(monkeypatch)
    assert show_in_engine({"VLLM_CONFIGURE_LOGGING": "0"}) is None
    assert bare_process.level == logging.NOTSET and bare_process.handlers == []
    assert show_in_engine({"VLLM_CONFIGURE_LOGGING": "0", "KVTIER_LOG_LEVEL": "DEBUG"}) is None
    assert bare_process.level == logging.DEBUG and bare_process.handlers == []
