"""The engine core's step and its plug-ins: the order of the hooks, what each hook sees, a
plug-in added from outside the package by ``_target_`` only, the per-phase profile, and beam
search going through the same step."""

from __future__ import annotations

import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.beam_search import BeamSearchParams
from paged_llm.engine.core import EngineCore, EnginePlugin, StepState
from paged_llm.engine.profile import HOST_PHASES, PHASES

PROMPTS = [{"prompt_token_ids": [5, 9, 17, 33, 2 + i] * (i + 1)} for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class HookLog(EnginePlugin):
    """Records every hook call and checks what each one sees; defined outside the package."""

    def __init__(self, engine, tag: str = "log") -> None:
        self.engine, self.tag = engine, tag
        self.calls: list[tuple[str, str]] = []
        self.tokens: dict[str, list[int]] = {}
        self.forgotten: list[str] = []

    def before_forward(self, step: StepState) -> None:
        """Nothing has run yet: no results, no sampled tokens."""
        assert not step.results and not step.sampled
        self.calls.append(("before", "scheduled" in step.marks and "forwarded" not in step.marks))

    def after_update(self, step: StepState) -> None:
        """The scheduler took exactly the sampled tokens."""
        self.calls.append(("after", "updated" in step.marks))
        for rid, ids in step.sampled.items():
            request = self.engine.scheduler.requests.get(rid)
            if request is not None:  # not finished: its output ends with the step's tokens
                assert request.output_token_ids[-len(ids) :] == ids
            self.tokens.setdefault(rid, []).extend(ids)

    def forget(self, request_id: str) -> None:
        """Every ended sequence is forgotten once."""
        assert request_id not in self.forgotten
        self.forgotten.append(request_id)


class FakeScheduler:
    """Two steps of nothing, recording the calls the core makes."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def schedule(self, now: float):
        """An empty step."""
        from paged_llm.core.scheduler import SchedulerOutput

        self.log.append("schedule")
        return SchedulerOutput(scheduled=[])

    def update_from_output(self, out, sampled, now):
        """Record the tokens handed over."""
        self.log.append(f"update {sampled}")
        return []

    def resolve_placeholders(self, tokens, now):
        """Record the tokens written over placeholders; finish every request."""
        self.log.append(f"resolve {[(r.request_id, t) for r, t in tokens]}")
        return [r for r, _ in tokens]


class Named(EnginePlugin):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def before_forward(self, step):
        self.log.append(f"{self.name}.before")

    def after_update(self, step):
        self.log.append(f"{self.name}.after")


def test_the_core_calls_the_hooks_in_order_around_the_forward():
    log: list[str] = []

    def forward(step):
        log.append("forward")
        step.sampled = {"r": [7]}

    core = EngineCore(FakeScheduler(log), forward, [Named("a", log), Named("b", log)], lambda: 1.0)
    step = core.step()
    assert log == ["schedule", "a.before", "b.before", "forward", "update {'r': [7]}",
                   "a.after", "b.after"]  # fmt: skip
    assert step.now == 1.0
    assert [m for m in step.marks] == ["start", "scheduled", "prepared", "forwarded", "updating",
                                       "updated"]  # fmt: skip
    marks = list(step.marks.values())
    assert marks == sorted(marks)
    log.clear()
    core.step(forward=lambda st: log.append("other forward"))  # beam search's way in
    assert log[3:5] == ["other forward", "update {}"]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    llm = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_plugin_from_outside_by_target_sees_every_step_and_changes_nothing(tiny_llama, plain):
    spec = {"_target_": f"{__name__}.HookLog", "tag": "mine"}
    llm = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01, plugins=[spec])
    engine = llm.llm_engine
    mine = engine.core.plugins[-1]
    assert isinstance(mine, HookLog) and mine.tag == "mine" and mine.engine is engine
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain  # a watching plug-in changes nothing
    steps = len(engine.iteration_stats)
    assert [c[0] for c in mine.calls] == ["before", "after"] * steps
    assert all(ok for _, ok in mine.calls)
    # every request's tokens passed through after_update, and each was forgotten at its end
    assert sorted(mine.tokens.values()) == sorted(plain)
    assert sorted(mine.forgotten) == sorted(mine.tokens)


def test_a_bad_plugin_target_fails_before_the_model_loads(tiny_llama):
    with pytest.raises(ValueError, match="NoSuchPlugin"):
        LLM(str(tiny_llama[0]), plugins=[{"_target_": f"{__name__}.NoSuchPlugin"}])
    with pytest.raises(ValueError, match="not an EnginePlugin"):
        LLM(str(tiny_llama[0]), plugins=["collections.Counter"])
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(str(tiny_llama[0]), plugin=["x"])


def test_the_phase_profile_accounts_for_every_step(tiny_llama):
    llm = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01,
              plugins=["paged_llm.engine.profile.StepPhaseProfile"])  # fmt: skip
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    profile = llm.llm_engine.core.plugins[-1].summary()
    assert profile["steps"] == len(llm.llm_engine.iteration_stats) > 1
    phases = profile["phases"]
    assert set(phases) == {name for name, _, _ in PHASES} | {"outputs", "caller"}
    assert all(p["seconds"] >= 0 for p in phases.values())
    assert abs(sum(p["share"] for p in phases.values()) - 1) < 1e-9
    assert phases["outputs"]["seconds"] > 0  # text and RequestOutputs take measurable time
    assert phases["inputs"]["seconds"] > 0  # the batch's tensors, apart from the model's time
    host = sum(phases[name]["ms_per_step"] for name in HOST_PHASES)
    assert profile["host_ms_per_step"] == pytest.approx(host)
    # a driver with its own forward (beam search) has no sampling phase of the runner's
    beam = llm.llm_engine.core.plugins[-1]
    beam.reset()
    llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert beam.steps > 0 and set(beam.seconds) >= {"schedule", "forward", "update"}
    assert "sample" not in beam.seconds and "inputs" not in beam.seconds


def test_beam_search_steps_through_the_core(tiny_llama):
    llm = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01,
              plugins=[f"{__name__}.HookLog"])  # fmt: skip
    log = llm.llm_engine.core.plugins[-1]
    outs = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(outs[0].sequences) == 2
    assert log.calls and len(log.calls) == 2 * len(llm.llm_engine.iteration_stats)
    assert not log.tokens or all(not ids for ids in log.tokens.values())  # beams pick tokens


def test_a_backend_that_needs_contiguous_caches_is_refused_under_paged_blocks(tiny_llama):
    with pytest.raises(ValueError, match="contiguous per-request caches.*not 'paged'"):
        LLM(str(tiny_llama[0]), attention_backend="contiguous", policy="paged")
    llm = LLM(str(tiny_llama[0]), attention_backend="contiguous", policy="orca_max",
              block_size=4, cpu_kv_cache_gib=0.01)  # fmt: skip
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_deferred_steps_plugins_run_when_its_tokens_are_resolved():
    """Async scheduling: the update takes placeholders and the plug-ins wait; ``resolve`` (a
    call later) writes the tokens in, adds the requests they finish, then calls the plug-ins."""
    from types import SimpleNamespace

    from paged_llm.core.request import PLACEHOLDER_TOKEN

    log: list[str] = []
    req = SimpleNamespace(request_id="r")

    class Deferred:
        requests = [req]

        def collect(self):
            log.append("collect")
            return [(req, 7)], {"r": "result"}

        def prompt_logprobs(self):
            return {}

    def forward(step):
        log.append("forward")
        step.deferred = Deferred()
        step.sampled = {"r": [PLACEHOLDER_TOKEN]}

    core = EngineCore(FakeScheduler(log), forward, [Named("a", log)], lambda: 2.0)
    step = core.launch()
    core.update(step)
    assert log == ["schedule", "a.before", "forward", "update {'r': [-1]}"]  # no a.after yet
    core.resolve(step)
    assert log[4:] == ["collect", "resolve [('r', 7)]", "a.after"]
    assert step.sampled == {"r": [7]} and step.results == {"r": "result"}
    assert step.finished == [req] and step.deferred is None
    core.resolve(step)  # resolved once only
    assert log[7:] == []


def test_plugins_written_against_the_old_import_path_still_load():
    """engine/plugins.py was the plug-in interface's home until 2026-12-07; it re-exports it."""
    from paged_llm.engine import plugins

    assert plugins.EnginePlugin is EnginePlugin and plugins.StepState is StepState
