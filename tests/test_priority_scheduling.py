"""vLLM's priority scheduling on the real engine: ``scheduling_policy="priority"`` admits smaller
``priority`` values first and preempts the least urgent running request, without changing any
request's tokens; a priority without it is refused. (The queue policy itself is property-tested
in test_scheduler.py.)"""

import httpx
import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser

PROMPTS = ["def f(x):", "import os\n", "class A:", "for i in range("]


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    """Each prompt's greedy tokens under first-come-first-served scheduling."""
    llm = LLM("tiny", max_model_len=128, cpu_kv_cache_gib=0.02)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24), use_tqdm=False)]


def test_one_at_a_time_in_priority_order(reference):
    llm = LLM("tiny", max_model_len=128, cpu_kv_cache_gib=0.02, max_num_seqs=1,
              scheduling_policy="priority")  # fmt: skip
    outs = llm.generate(PROMPTS, greedy(24), use_tqdm=False, priority=[3, 0, 2, 1])
    assert [o.outputs[0].token_ids for o in outs] == reference
    order = sorted(range(len(PROMPTS)), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 3, 2, 0]


def test_the_least_urgent_running_request_is_preempted(reference):
    """A lax request already running, then an urgent one and a long one: 41 blocks of demand
    in a 32-block pool. The lax request, admitted first, gives up its blocks (first come first
    served would preempt the newest, the long one); the urgent one is never preempted."""
    llm = LLM("tiny", max_model_len=128, block_size=4, num_gpu_blocks_override=32,
              scheduling_policy="priority")  # fmt: skip
    engine = llm.llm_engine
    engine.add_request("lax", PROMPTS[0], greedy(24), priority=5)
    engine.step()
    engine.add_request("urgent", PROMPTS[1], greedy(24), priority=0)
    engine.add_request("long", {"prompt_token_ids": [5] * 80}, greedy(20), priority=1)
    done, first_victim = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.metrics.num_preemptions and first_victim is None:
                first_victim = out.request_id
            if out.finished:
                done[out.request_id] = out
    assert first_victim == "lax"
    assert done["urgent"].metrics.num_preemptions == 0 and done["lax"].metrics.num_preemptions
    assert done["urgent"].outputs[0].token_ids == reference[1]
    assert done["lax"].outputs[0].token_ids == reference[0]


def test_priority_needs_the_priority_policy_and_one_integer_per_prompt():
    fcfs = LLM("tiny", max_model_len=64, cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.generate(PROMPTS[:2], greedy(2), use_tqdm=False, priority=[0, 1])
    assert not fcfs.llm_engine.has_unfinished_requests()
    fcfs.generate(PROMPTS[:2], greedy(2), use_tqdm=False, priority=[0, 0])  # 0 is the default
    prio = LLM("tiny", max_model_len=64, cpu_kv_cache_gib=0.01, scheduling_policy="priority")
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        prio.generate(PROMPTS[:3], greedy(2), use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        prio.generate(PROMPTS[:1], greedy(2), use_tqdm=False, priority=[0.5])
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM("tiny", scheduling_policy="shortest_first")


def test_server_takes_a_priority_field():
    argv = ["tiny", "--max-model-len", "128", "--cpu-kv-cache-gib", "0.01", "--disable-log-stats",
            "--scheduling-policy", "priority"]  # fmt: skip
    with ServerThread(build(make_parser().parse_args(argv))) as srv:
        body = {"prompt": "def f(x):", "max_tokens": 3, "priority": -2, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(srv.url + "/v1/completions", json={**body, "priority": "high"}, timeout=30)
        assert r.status_code == 400


def test_priority_experiment_shields_urgent_requests_under_overload(tmp_path):
    """experiments.priority_sim, short and synthetic: above the knee the urgent fifth keeps a
    low latency under priority scheduling, while under FCFS it queues like everyone else."""
    from experiments.priority_sim import run
    from paper_repro.common import compose

    cfg = compose("priority_sim", ["request_rates=[5.0]", "workload.duration_s=120",
                                   "workload.path=null", "progress=false"])  # fmt: skip
    runs = run(cfg, tmp_path)["runs"]["5.0"]
    fcfs, prio = runs["fcfs"], runs["priority"]
    assert prio["urgent"]["normalized_latency"] < 0.5 * fcfs["urgent"]["normalized_latency"]
    assert prio["urgent"]["median_ttft_ms"] < 0.2 * fcfs["urgent"]["median_ttft_ms"]
    assert prio["other"]["normalized_latency"] >= fcfs["other"]["normalized_latency"]
    assert fcfs["all"]["completed"] == prio["all"]["completed"]  # every request finishes
    assert (tmp_path / "priority_sim.png").exists() and (tmp_path / "priority_sim.csv").exists()
