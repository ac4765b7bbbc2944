"""The structured-output constraint a request may carry (vLLM's ``StructuredOutputsParams``);
``paged_llm.sampling_params`` re-exports it, where vLLM keeps it. The grammar that enforces it
is engine/structured_output.py's."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, with vLLM's fields; set exactly one. (vLLM's current
    name; ``GuidedDecodingParams`` is the older one, kept as an alias.)"""

    json: str | dict | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these
    grammar: str | None = None  # EBNF (GBNF dialect)
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]  # fmt: skip
        if len(given) != 1:
            raise ValueError(
                "guided decoding takes exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("guided choice must be a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"guided json schema is not valid JSON: {err}") from None

    def json_text(self) -> str:
        """The JSON schema as text."""
        return self.json if isinstance(self.json, str) else _json.dumps(self.json)

    def key(self) -> tuple[str, str]:
        """(kind, spec): what identifies the compiled grammar."""
        if self.json is not None:
            return "json schema", self.json_text()
        if self.json_object:
            return "json object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        return "grammar", str(self.grammar)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before v0.12
