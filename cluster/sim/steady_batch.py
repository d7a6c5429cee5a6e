"""A steady decode batch advanced lazily: its branches are touched only where something differs.

In a steady decode run every branch computes one token a step and samples the request's
placeholder token, so after ``k`` steps each branch has ``k`` more tokens, ``k`` more computed
positions and the blocks those positions fill. ``SimInstance`` applied that to every branch at
every run end (one pass over the batch per event: for a decode instance holding a thousand
branches, most of a large simulation's time). Here the batch keeps a clock (steps applied) and
per-run aggregates instead, so an event costs only what changes:

- the fewest steps left: a heap of the clock at which each branch finishes (ties in the
  engine's running order: priority, arrival, branch position);
- the context the next step attends to: ``sum(tokens - synced clock) + branches x clock``;
- the blocks a run takes: a branch needs a new block when the position it writes starts one,
  which for every branch recurs every ``block_size`` steps at a fixed phase of the clock; a
  histogram of branches by phase prices any run in ``block_size`` operations. The blocks are
  taken from the real ``BlockManager`` when the engine would take them (so its free count, what
  the router sees, is exact) and kept aside (``spare``) until a branch is *materialized*;
- a branch is materialized (its tokens appended, its computed count advanced, its blocks put in
  its table) only when something reads it: it finishes, it is cancelled or moved, or the real
  scheduler is about to run (``SimInstance.settle``).

Block ids handed out this way differ from the eager order, which only relabels blocks; it is
used only with the prefix cache off, where nothing depends on which id holds what.
"""
from __future__ import annotations

import heapq
from itertools import repeat


class _Member:
    __slots__ = ("seq", "req", "token", "sync", "base", "phase", "fin")

    def __init__(self, seq, req, token: int, sync: int, base: int, phase: int, fin: int):
        self.seq, self.req, self.token = seq, req, token
        self.sync = sync        # the clock its tokens, computed count and table are as of
        self.base = base        # tokens - sync (constant while it is a member)
        self.phase = phase      # (position it writes - clock) mod block size (constant)
        self.fin = fin          # the clock at which it has produced all its output tokens


class SteadyBatch:
    def __init__(self, bm):
        self.bm = bm
        self.bs = bm.block_size
        self.clock = 0
        self.members: dict[int, _Member] = {}   # seq id -> member, in no particular order
        self._fin: list = []                    # (fin, priority, arrival, position, seq id)
        self._hist = [0] * self.bs
        self._base = 0
        self.spare: list[int] = []              # blocks taken for members, not yet in their tables
        # 1 once the blocks of the step at ``clock`` are taken (a member's table then covers the
        # position it writes), 0 right after a run end (it covers only the computed positions).
        self.lead = 1

    def add(self, req, pos: int, seq, token: int, output_len: int) -> None:
        """A branch with exactly its sampled token to compute, its table as ``lead`` says."""
        c, bs = self.clock, self.bs
        n = len(seq.token_ids)
        m = _Member(seq, req, token, c, n - c, (seq.num_computed_tokens - c) % bs,
                    c + output_len - (n - seq.num_prompt_tokens))
        self.members[seq.seq_id] = m
        self._hist[m.phase] += 1
        self._base += m.base
        heapq.heappush(self._fin, (m.fin, req.priority, req.arrival, pos, seq.seq_id))

    def __len__(self) -> int:
        return len(self.members)

    @property
    def ctx(self) -> int:
        """Positions the step at ``clock`` attends to: every member's tokens."""
        return self._base + len(self.members) * self.clock

    def left(self) -> int:
        """Steps until the first member finishes."""
        fin, members = self._fin, self.members
        while fin:
            m = members.get(fin[0][4])
            if m is not None and m.fin == fin[0][0]:
                return m.fin - self.clock
            heapq.heappop(fin)
        return 0

    def growing(self) -> int:
        """Members whose write position at ``clock`` starts a new block."""
        return self._hist[-self.clock % self.bs]

    def need(self, k: int) -> int:
        """New blocks the members take in steps 2..k (k >= 1) of a run from ``clock`` (step 1's are taken).

        A member at ``r = (phase + clock) % bs`` takes ``(r + k - 1) // bs`` of them: with
        ``k - 1 = q * bs + rem``, that is ``q``, plus one when ``r >= bs - rem``. The members with
        such an ``r`` have the ``rem`` phases from ``(bs - rem - clock) % bs`` on (cyclically):
        one slice sum of the histogram, not a pass over every phase."""
        bs, hist = self.bs, self._hist
        q, rem = divmod(k - 1, bs)
        total = q * len(self.members)
        if rem:
            first = (bs - rem - self.clock) % bs
            end = first + rem
            total += sum(hist[first:end]) if end <= bs else sum(hist[first:]) + sum(hist[:end - bs])
        return total

    def steps_until_full(self, hi: int) -> int:
        """The most steps (<= hi) whose new blocks fit the free blocks."""
        free = self.bm.num_free_blocks
        if len(self.members) * -(-(hi - 1) // self.bs) <= free or self.need(hi) <= free:
            return hi
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.need(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def take(self, n: int) -> None:
        if n:
            ids = self.bm.allocate_blocks(n)
            if ids is None:
                raise RuntimeError(f"no room for {n} blocks inside a decode run")
            self.spare += ids

    def run_end(self, k: int) -> list[_Member]:
        """``k`` steps done: take their blocks, advance the clock. Returns the members that
        finished, materialized and removed, in running order."""
        self.take(self.need(k))
        self.clock += k
        self.lead = 0
        done, fin, members = [], self._fin, self.members
        while fin and fin[0][0] <= self.clock:
            f, *_, seq_id = heapq.heappop(fin)
            m = members.get(seq_id)
            if m is None or m.fin != f:
                continue
            if f != self.clock:
                raise RuntimeError(f"seq {seq_id} finished inside a decode run (clock {f} < {self.clock})")
            self.materialize(m)
            self.remove(m)
            done.append(m)
        return done

    def materialize(self, m: _Member) -> None:
        seq = m.seq
        owed = self.clock - m.sync
        if owed:
            seq.token_ids.extend(repeat(m.token, owed))
            seq.num_computed_tokens += owed
            m.sync = self.clock
        table = seq.block_table
        need = -(-(seq.num_computed_tokens + self.lead) // self.bs) - len(table)
        if need > 0:
            table += self.spare[-need:]
            del self.spare[-need:]

    def remove(self, m: _Member) -> None:
        del self.members[m.seq.seq_id]
        self._hist[m.phase] -= 1
        self._base -= m.base

    def settle_request(self, req) -> None:
        for seq in req.seqs:
            m = self.members.get(seq.seq_id)
            if m is not None:
                self.materialize(m)
                self.remove(m)

    def settle(self) -> None:
        """Materialize every member; the batch is empty afterwards."""
        for m in list(self.members.values()):
            self.materialize(m)
        if self.spare:
            raise RuntimeError(f"{len(self.spare)} blocks taken for the batch belong to no branch")
        self.members.clear()
        self._fin.clear()
        self._hist = [0] * self.bs
        self._base = 0
