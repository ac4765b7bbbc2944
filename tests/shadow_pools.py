"""A scheduler driver for property tests of block moves (shared by test_kv_offload.py and
test_kv_transfer.py): it schedules random requests to the end and plays every block move on
shadow pools that hold, per block, the token ids its KV was computed from, checking that every
block a scheduled request counts as computed holds exactly its tokens."""

from paged_llm.core.kv.paged import NULL_BLOCK
from paged_llm.core.request import Request
from paged_llm.core.scheduler import Scheduler
from paged_llm.sampling_params import SamplingParams

BS = 4  # block size of the property tests
MAX_LEN = 48
# where each kind of block move reads and writes ("store": a KV connector's, key -> tokens)
MOVES = {"copy": ("dev", "dev"), "swap_out": ("dev", "swap"), "swap_in": ("swap", "dev"),
         "offload": ("dev", "off"), "onload": ("off", "dev"),
         "kv_load": ("store", "dev")}  # fmt: skip


def prompt_of(family: int, length: int) -> list[int]:
    """Prompts of one family share their first tokens (a system prompt, a conversation)."""
    return [100 * family + j for j in range(length)]


def run_with_shadow_pools(kv, limits, requests, arrivals, store=None) -> Scheduler:
    """Serve ``requests`` ((family, prompt length, output length) each, ``arrivals`` per step)
    with the real scheduler over ``kv``; a KV connector's saves land in ``store`` after the
    step's forward pass, once per key and only for full blocks. Returns the scheduler, all
    requests finished and every block free."""
    sched = Scheduler(kv, limits)
    pools: dict[str, dict] = {"dev": {}, "swap": {}, "off": {}}
    pools["store"] = store if store is not None else {}  # the connector's own dict
    pending = list(enumerate(requests))
    for step in range(600):
        for _ in range(arrivals):  # a few arrive every step
            if pending:
                i, (family, length, out) = pending.pop(0)
                params = SamplingParams(max_tokens=out, ignore_eos=True)
                prompt = prompt_of(family, length)
                sched.add_request(Request(f"r{i}", prompt, params, max_model_len=MAX_LEN))
        if not sched.has_unfinished() and not pending:
            break
        out = sched.schedule(float(step))
        saves = []
        for kind, pairs in out.block_ops:  # in the order the runner applies them
            if kind == "kv_save":  # after the forward pass, as the runner does
                saves.extend(pairs)
                continue
            src, dst = MOVES[kind]
            for a, b in pairs:
                pools[dst][b] = pools[src].get(a)
        for s in out.scheduled:
            req, tokens = s.request, s.request.all_token_ids
            for i in range(req.num_computed_tokens // BS):  # computed, cached or moved back
                if s.block_table[i] != NULL_BLOCK:
                    assert pools["dev"][s.block_table[i]] == tuple(tokens[i * BS : (i + 1) * BS])
            end = req.num_computed_tokens + s.num_new_tokens
            for i in range(req.num_computed_tokens // BS, -(-end // BS)):  # the forward pass
                pools["dev"][s.block_table[i]] = tuple(tokens[i * BS : min((i + 1) * BS, end)])
        for block, key in saves:
            assert key not in pools["store"] and len(pools["dev"][block]) == BS
            pools["store"][key] = pools["dev"][block]
        sampled = {s.request.request_id: [7 + step % 5] for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled, float(step))
    assert not sched.has_unfinished() and not pending
    assert kv.num_free_blocks() == kv.num_blocks
    return sched
