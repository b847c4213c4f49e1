"""An LLM judge's verdict read as a score: a JSON object with a "score" ({"score": 7}) or a score
line ("Score: 7", "Score: 7/10", "**Score:** 7.5"); the last one in the text counts. A verdict
that is missing, unreadable or out of the rubric's range is a failure of its kind, never a guess."""

import json
import math
import re
from dataclasses import dataclass

VERDICT_FORMATS = ("auto", "json", "score_line")  # auto: a JSON verdict where there is one, else a score line
FAILURES = ("missing", "malformed", "out_of_range")

_SCORE_LINE = re.compile(r"\bscore\W{0,3}?\s*[:=]\s*\**\s*([^\s/*]+)(?:\s*/\s*([^\s*]+))?", re.IGNORECASE)
# a number as a judge writes it, with the quotes and punctuation around it
_WRITTEN_NUMBER = re.compile(r"[\"']?([-+]?(?:\d+\.?\d*|\.\d+))[\"']?[.,;:)}]*")
_SCORE_KEY = re.compile(r"[\"']score[\"']\s*:")


@dataclass(frozen=True)
class Verdict:
    score: float | None  # as the judge wrote it, within the range; None for a failure
    failure: str | None = None  # one of FAILURES
    detail: str = ""  # what was wrong, for the fault line


def parse_verdict(text: str, verdict_format: str, low: float, high: float) -> Verdict:
    """The judge's score in [low, high] from its output. A score line out of another scale
    ("4/5" where the range ends at 10) is malformed."""
    found = _json_score(text) if verdict_format in ("auto", "json") else None
    if not isinstance(found, tuple) and verdict_format in ("auto", "score_line"):
        found = _line_score(text) or found  # a JSON verdict that does not parse is malformed where no line reads
    if found is None:
        return Verdict(None, "missing", f"no {_expected(verdict_format)} in {text.strip()!r:.120}")
    if isinstance(found, Verdict):
        return found
    written, out_of = found
    score, scale = _number(written), None if out_of is None else _number(out_of)
    if score is None or (out_of is not None and scale is None):
        return Verdict(None, "malformed", f"the score {written!r:.40} is not a number")
    if scale is not None and scale != high:
        return Verdict(None, "malformed", f"scored out of {out_of}; the rubric's scale ends at {high:g}")
    if not low <= score <= high:
        return Verdict(None, "out_of_range", f"score {score:g} is outside [{low:g}, {high:g}]")
    return Verdict(score)


def normalized(score: float, low: float, high: float) -> float:
    """[low, high] -> [0, 1]."""
    return (score - low) / (high - low)


def _expected(verdict_format: str) -> str:
    return {"json": 'JSON {"score": ...}', "score_line": '"Score: n" line'}.get(
        verdict_format, 'JSON {"score": ...} or "Score: n" line')


def _json_score(text: str):
    """(the last JSON object's "score", None) where an object with one parses; a malformed
    Verdict where a "score" key is written but no object holding it parses; else None."""
    decoder, last = json.JSONDecoder(), None
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and "score" in value:
            last = value
    if last is not None:
        return last["score"], None
    if _SCORE_KEY.search(text):
        return Verdict(None, "malformed", f"a JSON verdict that does not parse: {text.strip()!r:.120}")
    return None


def _line_score(text: str):
    matches = _SCORE_LINE.findall(text)
    if not matches:
        return None
    written, out_of = matches[-1]
    return written, out_of or None


def _number(value) -> float | None:
    """A finite number from a JSON value or a written token ("7", "7.5.", "8,", '"9"}'), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _WRITTEN_NUMBER.fullmatch(str(value).strip())
        if not match:
            return None
        number = float(match.group(1))
    return number if math.isfinite(number) else None
