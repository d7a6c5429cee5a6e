"""Prefix journal: exact deltas since a cursor, full resyncs on a new epoch or a gap; the block
manager records exactly what enters and leaves its prefix cache."""
from thinkserve.workers.block_manager import BlockManager
from thinkserve.workers.prefix_journal import START, PrefixCursor, PrefixJournal
from thinkserve.workers.sequence import Sequence

BS = 4


def test_delta_since_a_cursor_is_the_net_change_per_hash():
    j = PrefixJournal()
    first = j.since(START)
    assert first.full and first.added == () and first.version == 0
    for h in (1, 2, 3):
        j.added(h)
    j.evicted(1)
    j.added(2)                          # already held: no event
    d = j.since(first.cursor)
    assert (d.full, sorted(d.added), d.evicted, d.version) == (False, [2, 3], (1,), 4)
    j.evicted(3)
    j.added(1)
    d2 = j.since(d.cursor)
    assert (sorted(d2.added), sorted(d2.evicted)) == ([1], [3])
    mirror = set()
    for delta in (first, d, d2):
        delta.apply_to(mirror)
    assert mirror == j.held == {1, 2}
    assert j.since(d2.cursor) == type(d2)(j.epoch, j.version)      # nothing new: an empty delta


def test_another_epoch_or_a_gap_past_the_kept_events_gets_a_full_resync():
    j = PrefixJournal(max_events=3)
    j.added(1)
    c = j.since(START).cursor
    for h in (2, 3, 4):
        j.added(h)
    assert not j.since(c).full                  # 3 events behind: still kept
    j.evicted(2)
    gap = j.since(c)                            # 4 behind, 3 kept
    assert gap.full and sorted(gap.added) == [1, 3, 4] and gap.evicted == ()
    restarted = PrefixJournal()                 # a new cache: its epoch differs
    restarted.added(9)
    assert restarted.since(PrefixCursor(j.epoch, 1)).full
    stale = {1, 2, 3}
    gap.apply_to(stale)
    assert stale == {1, 3, 4}                   # full: what the reader had is replaced


def seq(tokens, seq_id=0):
    return Sequence(seq_id, 0, list(tokens), len(tokens), seed=0)


def test_block_manager_journals_cached_and_evicted_blocks():
    bm = BlockManager(4, BS)
    a = seq(range(9))                           # 2 full blocks + 1 partial
    bm.allocate(a)
    a.num_computed_tokens = a.num_tokens
    bm.register_computed_blocks(a)
    assert bm.prefix_journal is None            # nobody follows it yet: nothing recorded
    c0 = bm.prefix_delta(START)                 # the first reader: a full resync of what is cached
    assert c0.full and sorted(c0.added) == sorted(a.block_hashes[:2])
    j = bm.prefix_journal
    bm.free(a)                                  # freed, still cached: no event
    assert j.since(c0.cursor).added == () and j.since(c0.cursor).evicted == ()
    b = seq(range(100, 112), 1)                 # 3 blocks: the 2 free ones, then evicts a's tail block
    bm.allocate(b)
    d = j.since(c0.cursor)
    assert d.evicted == (a.block_hashes[1],) and d.added == ()
    bm.check_integrity([b.block_table])         # the journal's set equals the prefix cache's
    assert j.held == {a.block_hashes[0]}
