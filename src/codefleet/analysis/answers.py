"""Reading a model's answer: the first JSON object in it, whatever the model wrote around it (code fences, prose,
a second object). Used by the judge's verdicts and by its clusters."""

from __future__ import annotations

import json
import re


def first_json_object(text: str):
    """The first JSON object in a model's answer (fences and text around it ignored); ValueError if none."""
    text = text or ""
    cleaned = re.sub(r"^```(json)?|```$", "", text.strip()).strip()
    start, end = cleaned.find("{"), cleaned.rfind("}")
    if start < 0 or end <= start:
        raise ValueError(f"no JSON object in the answer: {text[:120]!r}")
    try:  # the first JSON object; a judge may write more after it
        return json.JSONDecoder().raw_decode(cleaned[start : end + 1])[0]
    except json.JSONDecodeError as e:
        raise ValueError(f"answer is not valid JSON ({e.msg}): {text[:120]!r}") from e
