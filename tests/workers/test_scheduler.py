"""Scheduler: chunked prefill under the token budget, batching, priorities, preemption, fork.

The scheduler is driven without a model: after each plan the test appends a token to every
sequence that sampled, which is all the engine does with a sample as far as scheduling goes.
"""
from thinkserve.workers.block_manager import BlockManager
from thinkserve.workers.config import EngineConfig
from thinkserve.workers.migration import build_request, export, import_seqs
from thinkserve.workers.sampling_params import SamplingParams, branch_seed
from thinkserve.workers.scheduler import Scheduler
from thinkserve.workers.sequence import Request, RequestStatus, Sequence

BS = 4


def make(num_blocks=32, num_host_blocks=0, **cfg):
    cfg.setdefault("max_num_batched_tokens", 64)
    config = EngineConfig(block_size=BS, num_device_blocks=num_blocks, num_host_blocks=num_host_blocks, **cfg)
    return Scheduler(config, BlockManager(num_blocks, BS, num_host_blocks=num_host_blocks))


_arrivals = iter(range(10**6))


def add(sched, rid, prompt_len, *, n=1, priority=0, seed=7, first_token=None):
    # Distinct prompts unless a test asks for shared ones (identical prompts hit the prefix cache).
    first_token = 1000 * (1 + next(_arrivals)) if first_token is None else first_token
    prompt = list(range(first_token, first_token + prompt_len))
    params = SamplingParams(n=n, seed=seed, max_tokens=100)
    root = Sequence(sched.new_seq_id(), 0, list(prompt), prompt_len, branch_seed(seed, 0))
    req = Request(rid, prompt, params, priority, next(_arrivals), [root], forked=n == 1)
    sched.add(req)
    return req


def step(sched, token=1):
    out = sched.schedule()
    sched.on_computed(out)
    for w in out.work:
        if w.samples:
            w.seq.token_ids.append(token)
    return out


def planned(out):
    return [(s.seq_id, len(s.token_ids), s.start_pos, s.sampling is not None) for s in out.plan.seqs]


def check(sched):
    sched.bm.check_integrity(sched.block_tables(), sched.host_block_tables())
    assert sched.num_running_seqs() == sched.recount_running_seqs()


def test_chunked_prefill_respects_the_token_budget():
    sched = make(max_num_batched_tokens=8)
    req = add(sched, "a", 20)
    sid = req.seqs[0].seq_id
    assert planned(step(sched)) == [(sid, 8, 0, False)]
    assert planned(step(sched)) == [(sid, 8, 8, False)]
    out = step(sched)
    assert planned(out) == [(sid, 4, 16, True)]
    assert out.plan.seqs[0].block_table == tuple(req.seqs[0].block_table[:5])
    assert out.plan.seqs[0].sampling.output_index == 0
    out = step(sched)
    assert planned(out) == [(sid, 1, 20, True)]
    assert out.plan.seqs[0].sampling.output_index == 1
    check(sched)


def test_decodes_go_first_and_a_new_prefill_takes_the_rest_of_the_budget():
    sched = make(max_num_batched_tokens=10)
    a = add(sched, "a", 3)
    b = add(sched, "b", 3)
    out = step(sched)
    assert [len(s.token_ids) for s in out.plan.seqs] == [3, 3]
    c = add(sched, "c", 30)
    out = step(sched)
    assert planned(out) == [(a.seqs[0].seq_id, 1, 3, True), (b.seqs[0].seq_id, 1, 3, True),
                            (c.seqs[0].seq_id, 8, 0, False)]
    check(sched)


def test_priority_classes_then_fcfs():
    sched = make(max_num_batched_tokens=5)
    add(sched, "late-low", 5, priority=2)
    add(sched, "urgent", 5, priority=0)
    add(sched, "normal-1", 5, priority=1)
    add(sched, "normal-2", 5, priority=1)
    order = []
    for _ in range(4):
        out = step(sched)
        order.append(out.work[-1].request.request_id)
        for w in out.work:  # finish each right away so the next one gets the budget
            sched.finish_seq(w.request, w.seq, "stop")
    assert order == ["urgent", "normal-1", "normal-2", "late-low"]
    check(sched)


def test_max_num_seqs_limits_admission():
    sched = make(max_num_seqs=2)
    add(sched, "a", 2)
    add(sched, "b", 2)
    add(sched, "c", 2)
    out = step(sched)
    assert {w.request.request_id for w in out.work} == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preemption_by_recompute_picks_the_least_urgent_latest_request():
    # 4 blocks of 4 tokens: three 4-token prompts fill 3 blocks, decoding needs a block each.
    sched = make(num_blocks=4, preemption_mode="recompute")
    a = add(sched, "a", 4, priority=0)
    b = add(sched, "b", 4, priority=1)
    c = add(sched, "c", 4, priority=1)
    step(sched)
    assert sched.bm.num_free_blocks == 1
    out = step(sched)  # a takes the last block; b needs one: c (same class, later) is the victim
    assert [r.request_id for r in out.preempted] == ["c"]
    assert c.status is RequestStatus.WAITING and c.seqs[0].num_computed_tokens == 0
    assert c.seqs[0].token_ids[-1] == 1  # its sampled token is kept and will be recomputed
    assert [w.request.request_id for w in out.work] == ["a", "b"]
    check(sched)
    sched.finish_seq(a, a.seqs[0], "stop")
    out = step(sched)
    # c comes back and prefills prompt + its output token
    assert any(w.request is c and w.num_tokens == 5 for w in out.work)
    check(sched)


def test_preemption_by_swap_moves_blocks_to_host_and_back():
    sched = make(num_blocks=4, num_host_blocks=8, preemption_mode="swap")
    a = add(sched, "a", 4)
    b = add(sched, "b", 4)
    c = add(sched, "c", 4)
    step(sched)
    c_blocks = list(c.seqs[0].block_table)
    out = step(sched)
    assert c.status is RequestStatus.SWAPPED
    assert out.plan.blocks_to_swap_out == ((c_blocks[0], 0),)
    assert c.seqs[0].host_block_table == [0] and c.seqs[0].num_computed_tokens == 4
    check(sched)
    sched.finish_seq(a, a.seqs[0], "stop")
    sched.finish_seq(b, b.seqs[0], "stop")
    out = step(sched)
    assert len(out.plan.blocks_to_swap_in) == 1 and out.plan.blocks_to_swap_in[0][0] == 0
    assert c.status is RequestStatus.RUNNING
    assert planned(out) == [(c.seqs[0].seq_id, 1, 4, True)]  # continues decoding, nothing recomputed
    check(sched)


def test_swap_falls_back_to_recompute_without_host_room():
    sched = make(num_blocks=4, num_host_blocks=0, preemption_mode="swap")
    add(sched, "a", 4)
    add(sched, "b", 4)
    c = add(sched, "c", 4)
    step(sched)
    step(sched)
    assert c.status is RequestStatus.WAITING and c.seqs[0].block_table == []
    check(sched)


def test_urgent_arrival_preempts_a_less_urgent_running_request():
    sched = make(num_blocks=4, preemption_mode="recompute")
    low = add(sched, "low", 12, priority=5)
    step(sched)
    assert sched.bm.num_free_blocks == 1
    add(sched, "high", 8, priority=0)
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["low"]
    assert [w.request.request_id for w in out.work] == ["high"]
    assert low.status is RequestStatus.WAITING
    check(sched)


def test_same_class_arrival_does_not_preempt():
    sched = make(num_blocks=4, preemption_mode="recompute")
    add(sched, "first", 12, priority=1)
    step(sched)
    add(sched, "second", 8, priority=1)
    out = step(sched)
    assert not out.preempted
    assert [w.request.request_id for w in out.work] == ["first"]


def test_best_of_n_prefills_once_then_forks_sharing_blocks():
    sched = make()
    req = add(sched, "bon", 6, n=3)  # blocks: [0..3] [4 5 | ...]
    root = req.seqs[0]
    out = sched.schedule()
    # the whole prompt once, sampling all three first tokens from its last position (fan-out)
    assert planned(out) == [(root.seq_id, 6, 0, True)]
    fanout = out.plan.seqs[0].fanout
    assert [(sp.seed, sp.output_index) for _, sp in fanout] == [(branch_seed(7, 1), 0), (branch_seed(7, 2), 0)]
    sched.on_computed(out)
    assert len(req.seqs) == 3 and req.forked
    assert [s.seq_id for s in req.seqs[1:]] == [sid for sid, _ in fanout]
    assert [(w.seq.seq_id, w.samples) for w in out.work] == [(s.seq_id, True) for s in req.seqs]
    tables = [s.block_table for s in req.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert all(s.num_computed_tokens == 6 for s in req.seqs)
    for w in out.work:
        w.seq.token_ids.append(1)
    out = step(sched)
    # every branch writes its first output token; the partial prompt block is copied on write
    assert [(len(s.token_ids), s.start_pos, s.sampling.seed) for s in out.plan.seqs] == \
        [(1, 6, branch_seed(7, 0)), (1, 6, branch_seed(7, 1)), (1, 6, branch_seed(7, 2))]
    assert len(out.plan.blocks_to_copy) == 2  # the last branch keeps the original
    assert len({s.block_table[0] for s in req.seqs}) == 1  # the full prompt block stays shared
    assert len({s.block_table[1] for s in req.seqs}) == 3
    check(sched)
    for s in req.seqs:
        sched.finish_seq(req, s, "stop")
    assert sched.bm.num_free_blocks == 32 and not sched.has_unfinished()
    check(sched)


def test_prefix_hit_skips_computing_cached_blocks():
    sched = make()
    a = add(sched, "a", 9, first_token=5)
    step(sched)
    sched.finish_seq(a, a.seqs[0], "stop")
    b = add(sched, "b", 10, first_token=5)  # same first 9 tokens
    out = step(sched)
    assert planned(out) == [(b.seqs[0].seq_id, 2, 8, True)]
    check(sched)


def test_request_that_cannot_fit_alone_is_reported():
    sched = make(num_blocks=2, preemption_mode="recompute")
    req = add(sched, "big", 8)
    step(sched)  # uses both blocks; the first output token needs a third
    out = sched.schedule()
    assert out.out_of_capacity == [req]


def test_abort_frees_everything_in_any_state():
    sched = make(num_blocks=4, num_host_blocks=8)
    add(sched, "a", 4)
    add(sched, "b", 4)
    add(sched, "c", 4)
    add(sched, "d", 4)
    step(sched)
    step(sched)  # someone is swapped now, d is waiting
    assert sched.swapped
    for rid in ["a", "b", "c", "d"]:
        assert sched.abort(rid) is not None
    assert sched.abort("a") is None
    assert sched.bm.num_free_blocks == 4 and sched.bm.host.num_free_blocks == 8
    check(sched)


def _steady_pair():
    """Two schedulers in the same state: three requests decoding (one of them Best-of-2, forked),
    a queue of three behind them (priority 1; the budget and the blocks admit only some)."""
    pair = []
    for _ in range(2):
        sched = make(num_blocks=40, max_num_seqs=8, max_num_batched_tokens=12)
        for rid, n in (("a", 1), ("b", 2), ("c", 1)):
            add(sched, rid, 5, n=n, first_token=100 * (ord(rid)))
        for _ in range(4):
            step(sched)
        for rid, plen in (("q1", 6), ("q2", 5), ("q3", 4)):
            add(sched, rid, plen, priority=1, first_token=100 * int(rid[1]) + 5000)
        pair.append(sched)
    return pair


def test_admit_behind_a_steady_batch_equals_the_admission_of_schedule():
    """``Scheduler.admit`` (the simulator's lazy batch: its branches' blocks taken, only the
    queue scheduled) admits what ``schedule()`` admits after the running branches' tokens, and
    leaves the queues and the block pool the same."""
    full, lazy = _steady_pair()
    assert full.queue_is_behind_running() and lazy.queue_is_behind_running()
    out = full.schedule()
    steady = [w for w in out.work if w.request.request_id in ("a", "b", "c")]
    assert [w.num_tokens for w in steady] == [1, 1, 1, 1]
    for req in lazy.running:  # what the simulator's batch does for its branches
        for seq in req.unfinished_seqs:
            assert lazy.bm.append_slots(seq) == []
    admitted = lazy.admit(len(steady))
    assert planned(admitted) == planned(out)[len(steady):] != []
    assert [w.request.request_id for w in admitted.work] == [w.request.request_id for w in out.work[len(steady):]]
    for a, b in ((full.running, lazy.running), (full.waiting, lazy.waiting)):
        assert [r.request_id for r in a] == [r.request_id for r in b]
    assert full.bm.num_free_blocks == lazy.bm.num_free_blocks
    check(lazy)


def test_a_queue_ahead_of_a_running_request_is_not_behind_it():
    sched = make(max_num_seqs=1)
    add(sched, "low", 3, priority=1)
    step(sched)
    add(sched, "urgent", 3, priority=0)
    assert not sched.queue_is_behind_running()
    add(sched, "later", 3, priority=2)
    assert not sched.queue_is_behind_running()  # the head (urgent) decides


# ---- imports: admitted under max_num_seqs, behind queued requests of their priority ----------
def prefilled(rid, prompt_len, *, priority=0):
    """The page set a prefill instance sends for a request whose prompt is computed and whose
    first token is sampled."""
    src = make(num_blocks=16, role="prefill")
    req = add(src, rid, prompt_len, priority=priority)
    step(src)
    src.detach(req)
    return export(req, BS)


def import_into(sched, exported):
    """What the engine's ``import_request`` + ``commit_import`` (and the simulator) do; None: refused."""
    ids = sched.reserve_import(exported.request_id, import_seqs(exported), len(exported.block_ids),
                               exported.priority)
    if ids is None:
        return None
    req = build_request(exported, ids, sched.bm, sched.new_seq_id, next(_arrivals))
    sched.start_import(req)
    return req


def test_an_import_waits_for_a_batch_slot_behind_a_queued_request():
    """A decode instance at max_num_seqs with a request queued (e.g. preempted): an import that
    arrives as a slot frees does not take it; the queued request does, and the import comes in
    at the next free slot. The batch never exceeds its cap."""
    sched = make(max_num_seqs=2)
    a, b = import_into(sched, prefilled("a", 4)), import_into(sched, prefilled("b", 4))
    assert a.status is b.status is RequestStatus.RUNNING
    assert import_into(sched, prefilled("full", 4)) is None     # no free slot: nothing taken
    w = add(sched, "w", 4)
    step(sched)
    assert w.status is RequestStatus.WAITING                     # 2 running: no slot for it
    sched.finish_seq(a, a.seqs[0], "stop")
    free = sched.bm.num_free_blocks
    c = prefilled("c", 4)
    assert import_into(sched, c) is None                         # the free slot is w's
    assert sched.bm.num_free_blocks == free and "c" not in sched.requests
    out = step(sched)
    assert w.status is RequestStatus.RUNNING and any(x.request is w for x in out.work)
    assert import_into(sched, c) is None                         # b and w fill the batch
    sched.finish_seq(b, b.seqs[0], "stop")
    assert import_into(sched, c).status is RequestStatus.RUNNING
    assert sched.num_running_seqs() == 2
    check(sched)


def test_an_urgent_import_passes_a_less_urgent_queue_but_not_the_cap():
    sched = make(max_num_seqs=2)
    import_into(sched, prefilled("a", 4))
    low = add(sched, "low", 4, priority=2)
    assert import_into(sched, prefilled("urgent", 4, priority=0)).status is RequestStatus.RUNNING
    assert import_into(sched, prefilled("urgent-2", 4, priority=0)) is None     # the cap holds
    step(sched)
    assert low.status is RequestStatus.WAITING and sched.num_running_seqs() == 2
    check(sched)


def test_a_refused_import_holds_no_block_so_it_and_the_queue_cannot_block_each_other():
    """Free batch slots, but the blocks an import would take are the queued request's: it is
    refused without taking any, the queued request is admitted, and the import comes in once
    blocks are free again; every block comes back at the end."""
    sched = make(num_blocks=8, max_num_seqs=4)
    r = import_into(sched, prefilled("r", 8))                   # 2 blocks
    w = add(sched, "w", 20)                                     # needs 5 of the 6 free
    i = prefilled("i", 8)                                       # 2 blocks: would leave w 4
    assert import_into(sched, i) is None and sched.bm.num_free_blocks == 6
    step(sched)                                                 # r takes its 3rd block, w its 5
    assert w.status is RequestStatus.RUNNING and sched.bm.num_free_blocks == 0
    assert import_into(sched, i) is None and sched.bm.num_free_blocks == 0     # no room: nothing held
    sched.finish_seq(r, r.seqs[0], "stop")
    got = import_into(sched, i)
    assert got.status is RequestStatus.RUNNING and sched.bm.num_free_blocks == 1
    for req in (w, got):
        sched.finish_seq(req, req.seqs[0], "stop")
    check(sched)
    assert sched.bm.num_free_blocks == 8 and not sched.has_unfinished()


def test_an_import_without_kv_queues_whatever_the_batch():
    sched = make(max_num_seqs=1)
    import_into(sched, prefilled("a", 4))
    add(sched, "w", 4)
    resumed = import_into(sched, prefilled("resume", 4).without_kv())
    assert resumed.status is RequestStatus.WAITING and [r.request_id for r in sched.waiting] == ["w", "resume"]


def test_the_running_branch_count_follows_forks_finishes_preemptions_and_aborts():
    """``num_running_seqs`` is kept as requests come and go, not summed per read: it equals a
    fresh count after every change, and the batch slots each change should give or take."""
    sched = make(num_blocks=24, max_num_seqs=16, max_num_batched_tokens=4)
    a = add(sched, "a", 6, n=3)                  # Best-of-3: 3 slots from admission, before the fork
    b = add(sched, "b", 5)
    step(sched)                                  # a's first prompt chunk: admitted, not forked
    assert not a.forked and len(a.seqs) == 1 and sched.num_running_seqs() == 3
    check(sched)
    while not (a.forked and b in sched.running):
        step(sched)
    assert len(a.seqs) == 3 and sched.num_running_seqs() == 4    # forked into 3 branches: still 3 slots
    check(sched)
    sched.finish_seq(a, a.seqs[1], "stop")       # one branch done: its slot back
    assert sched.num_running_seqs() == 3
    check(sched)
    sched.finish_seq(b, b.seqs[0], "stop")       # b done: detached with its slot
    assert sched.num_running_seqs() == 2 and b not in sched.running
    check(sched)
    c = add(sched, "c", 4, priority=0)
    step(sched)
    assert sched.num_running_seqs() == 3
    check(sched)
    sched.abort("a")                             # a's two live branches go
    assert sched.num_running_seqs() == 1
    check(sched)
    sched.hold(c)                                # prefill role: held, not running
    assert sched.num_running_seqs() == 0 == sched.recount_running_seqs()
