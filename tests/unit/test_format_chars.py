"""Unicode format characters (Cf) and line/paragraph separators (Zl, Zp) are refused in
envelope ids and escaped in both log formats; other non-ASCII text is left alone."""

from __future__ import annotations

import json
import logging

import pytest

from broker_adapter.app.logs import JsonFormatter, TextFormatter
from broker_adapter.errors import EnvelopeError
from tests.support.ingest_script import envelope

REFUSED = ["\u202e", "\u2028", "\u2029", "\u200b", "\ufeff", "\u00ad", "\U000e0041"]
ACCEPTED = ["\u00e9", "\u4e2d", "\u00a0", "\U0001f600"]  # letters, no-break space, emoji


@pytest.mark.parametrize("char", REFUSED)
@pytest.mark.parametrize("field", ["message_id", "correlation_id", "parent_id"])
def test_format_and_separator_characters_are_refused_in_ids(char: str, field: str) -> None:
    value = f"id{char}x"
    with pytest.raises(EnvelopeError) as info:
        envelope("m1", **{field: value}) if field != "message_id" else envelope(value)
    assert (info.value.field, info.value.reason) == (field, "format_char")
    assert f"U+{ord(char):04X}" in info.value.detail


@pytest.mark.parametrize("char", ACCEPTED)
def test_other_non_ascii_characters_stay_allowed(char: str) -> None:
    assert envelope(f"id{char}x").message_id == f"id{char}x"


def _record(message: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("t", logging.WARNING, __file__, 1, "%s", (message,), None)
    record.__dict__.update(extra)
    return record


def test_both_log_formats_escape_format_and_separator_characters() -> None:
    said = "entry a\u202eb\u2028c\U000e0041 \u00e9"
    text = TextFormatter().format(_record(said, message_id="x\u2029y"))
    assert "\u202e" not in text
    assert "\u2028" not in text
    assert "\u2029" not in text
    assert "\\u202e" in text
    assert "\\u2028" in text
    assert "\\udb40\\udc41" in text
    assert "\u00e9" in text  # other text stays as it is
    line = JsonFormatter().format(_record(said, message_id="x\u2029y"))
    assert not set(line) & {"\u202e", "\u2028", "\u2029", "\U000e0041"}
    parsed = json.loads(line)  # still one valid JSON object, with the original text
    assert parsed["message"] == said
    assert parsed["message_id"] == "x\u2029y"
