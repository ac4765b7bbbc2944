"""The torch-free core asks a request's grammar and stop strings only through the Protocols of
core/stop_conditions.py: the engine's classes implement them, objects written outside the
package work in their place, and no core module imports the engine, the runner or torch."""

import ast
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from paged_llm.core.request import Request, RequestStatus
from paged_llm.core.stop_conditions import OutputConstraint, StopCondition
from paged_llm.engine.reasoning import AfterReasoning
from paged_llm.engine.stop_strings import StopStringChecker
from paged_llm.engine.structured_output import GrammarGuide
from paged_llm.sampling_params import SamplingParams

CORE = Path(__file__).parents[1] / "paged_llm" / "core"


def test_the_engines_guides_and_stop_strings_implement_the_core_protocols():
    assert issubclass(GrammarGuide, OutputConstraint)
    assert issubclass(AfterReasoning, OutputConstraint)
    assert issubclass(StopStringChecker, StopCondition)


def test_no_core_module_imports_the_engine_the_runner_or_torch():
    banned = ("paged_llm.engine", "paged_llm.runner", "torch")
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n.startswith(banned)]
    assert not found


class EndsAfter:
    """A grammar written outside the package: complete after ``n`` tokens; records them."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, []

    def accept(self, token_id: int) -> None:
        self.seen.append(token_id)

    def is_terminated(self) -> bool:
        return len(self.seen) >= self.n


class StopAt:
    """A stop condition written outside the package: the output's newest token is ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, output_token_ids):
        return f"<{self.token}>" if output_token_ids[-1] == self.token else None


@given(
    tokens=st.lists(st.integers(1, 5), min_size=1, max_size=12),
    grammar_len=st.none() | st.integers(1, 12),
    stop_token=st.none() | st.integers(1, 5),
    max_tokens=st.integers(1, 12),
    min_tokens=st.integers(0, 4),
)
def test_a_request_stops_where_its_protocol_objects_say(
    tokens, grammar_len, stop_token, max_tokens, min_tokens
):
    """Appending tokens one at a time, the request finishes at the first token where the stop
    condition fires (reason: its string, status stop, even on the last allowed token), the
    grammar is complete (stop, even before min_tokens) or max_tokens is reached (length); the
    grammar hears every appended token."""
    min_tokens = min(min_tokens, max_tokens)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=True)
    guide = EndsAfter(grammar_len) if grammar_len else None
    stops = StopAt(stop_token) if stop_token else None
    req = Request("r", [1, 2], params, guide=guide, stop_strings=stops)
    status = None
    for i, token in enumerate(tokens):
        req.append_token(token, now=float(i))
        status = req.check_stop()
        if status is not None:
            break
    n = req.num_output_tokens
    if guide is not None:
        assert guide.seen == req.output_token_ids
    stopped_by_string = stops is not None and req.output_token_ids[-1] == stop_token
    if stopped_by_string:
        assert status is RequestStatus.FINISHED_STOPPED and req.stop_reason == f"<{stop_token}>"
    elif n >= max_tokens:
        assert status is RequestStatus.FINISHED_LENGTH
    elif guide is not None and n >= grammar_len:
        assert status is RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    else:
        assert status is None and n == len(tokens)
