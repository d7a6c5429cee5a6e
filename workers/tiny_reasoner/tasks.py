"""The tiny-reasoner's task family: problems with checkable integer answers and a worked
``<think>`` chain whose length grows with the level, from ~10 tokens to ~1,450.

Pure Python (no torch): the trainer, the benchmark, the router's tests and the simulator all
use it.

Two kinds of problem, nine levels:

* ``add`` (levels 1-3): ``37+48=`` -> column addition, least significant column first, one
  short line per column, then the answer::

      <think>7+8=15,3+4+1=8</think>answer: 85

* ``collatz`` (levels 4-9): ``collatz(6)=`` asks how many Collatz steps (halve an even number,
  map an odd one to 3x+1) take the number to 1. One line per step::

      <think>000:600000
      001/300000
      002*010000
      ...
      008/100000
      </think>answer: 8

  A line is ``CCC`` (step counter, 3 digits, most significant first), an operator (``:`` the
  start, ``/`` halved, ``*`` tripled plus one) and ``X`` (the value, 6 digits, *least*
  significant first, zero padded).

Why this shape: a 2-million-parameter model trained for an hour on two CPU cores can only learn
steps that are local. Every line has the same length (11 tokens), so each token depends only on
tokens a *constant* distance back: the same digit one line up (``x/2`` needs its neighbour too,
``3x+1`` the carry from the digit just written, which is why ``X`` runs least significant digit
first). The counter's increment only looks at the two digits after it, and the answer copies the
final counter, so no step ever has to reverse a number or look far back. The chain length is set
by the problem and is hard to predict from the prompt, as a real reasoning model's is; levels
bucket problems by their number of steps.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache

THINK_START = "<think>"
THINK_END = "</think>"
ANSWER_PREFIX = "answer: "

COLLATZ_WIDTH = 6  # digits of X in a chain line; trajectories must stay below 10**6
COLLATZ_MAX_START = 99_999  # start numbers are drawn from 1..99,999
COUNTER_WIDTH = 3
COLLATZ_LINE_TOKENS = COUNTER_WIDTH + 1 + COLLATZ_WIDTH + 1  # "CCC" op "XXXXXX" "\n"


@dataclass(frozen=True)
class Level:
    """One difficulty level. ``add``: ``lo..hi`` is the number of digits of both operands;
    ``collatz``: the inclusive range of step counts."""

    level: int
    kind: str  # "add" | "collatz"
    lo: int
    hi: int

    @property
    def name(self) -> str:
        if self.kind == "add":
            return f"L{self.level} add {self.lo}-digit"
        return f"L{self.level} collatz {self.lo}-{self.hi} steps"


LEVELS: tuple[Level, ...] = (
    Level(1, "add", 1, 1),
    Level(2, "add", 2, 2),
    Level(3, "add", 3, 3),
    Level(4, "collatz", 1, 8),
    Level(5, "collatz", 9, 24),
    Level(6, "collatz", 25, 48),
    Level(7, "collatz", 49, 80),
    Level(8, "collatz", 81, 110),
    Level(9, "collatz", 111, 130),
)
LEVEL_BY_ID = {lv.level: lv for lv in LEVELS}

# A "realistic" request mix for benchmarks: mostly short problems, a tail of long chains
# (its output lengths have p99 well over 20x the median; see tests).
REALISTIC_MIX: dict[int, float] = {1: 0.22, 2: 0.2, 3: 0.16, 4: 0.12, 5: 0.1, 6: 0.08, 7: 0.06, 8: 0.04, 9: 0.02}


@dataclass(frozen=True)
class Problem:
    level: int
    kind: str
    operands: tuple[int, ...]  # add: (a, b); collatz: (n,)
    answer: int


def get_level(level: int) -> Level:
    try:
        return LEVEL_BY_ID[level]
    except KeyError:
        raise ValueError(f"level must be one of {sorted(LEVEL_BY_ID)}, got {level}") from None


# ---------------------------------------------------------------- collatz


def collatz_trajectory(n: int) -> list[int]:
    """``n, f(n), f(f(n)), ..., 1`` (just ``[1]`` for ``n == 1``)."""
    if n < 1:
        raise ValueError(f"collatz start must be >= 1, got {n}")
    out = [n]
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        out.append(n)
    return out


@lru_cache(maxsize=1)
def _collatz_table() -> tuple[tuple[int, int], ...]:
    """(steps, peak) for every start 1..COLLATZ_MAX_START (index 0 unused), memoized."""
    steps = [0] * (COLLATZ_MAX_START + 1)
    peak = [0] * (COLLATZ_MAX_START + 1)
    steps[1], peak[1] = 0, 1
    for start in range(2, COLLATZ_MAX_START + 1):
        path, n = [], start
        while n > COLLATZ_MAX_START or (n != 1 and steps[n] == 0):
            path.append(n)
            n = n // 2 if n % 2 == 0 else 3 * n + 1
        s, p = steps[n], peak[n]
        for m in reversed(path):
            s, p = s + 1, max(p, m)
            if m <= COLLATZ_MAX_START:
                steps[m], peak[m] = s, p
    return tuple(zip(steps, peak))


@lru_cache(maxsize=None)
def _collatz_pool(lo: int, hi: int) -> tuple[int, ...]:
    """Starts whose step count is in ``lo..hi`` and whose trajectory fits in the chain width."""
    table = _collatz_table()
    limit = 10**COLLATZ_WIDTH
    return tuple(n for n in range(1, COLLATZ_MAX_START + 1) if lo <= table[n][0] <= hi and table[n][1] < limit)


# ---------------------------------------------------------------- held-out split


def _bucket(key: tuple[int, ...]) -> int:
    """A stable pseudo-random bucket 0..9 of a problem (Python's ``hash`` is salted per process)."""
    h = 0x9E3779B9
    for k in key:
        h = ((h ^ k) * 0x01000193 + 0x7F4A7C15) & 0xFFFFFFFF
        h ^= h >> 15
    return h % 10


def in_split(problem_key: tuple[int, ...], split: str) -> bool:
    """``test`` holds out one problem in ten (by a stable hash of its operands); ``train`` is
    the rest; ``all`` is everything. Levels with tiny pools (level 1, 4) are shared: see README."""
    if split == "all":
        return True
    held_out = _bucket(problem_key) == 0
    if split == "test":
        return held_out
    if split == "train":
        return not held_out
    raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")


# ---------------------------------------------------------------- generation


def make_problem(level: int, operands: tuple[int, ...]) -> Problem:
    lv = get_level(level)
    if lv.kind == "add":
        a, b = operands
        return Problem(level, "add", (a, b), a + b)
    (n,) = operands
    return Problem(level, "collatz", (n,), len(collatz_trajectory(n)) - 1)


def sample_problem(level: int, rng: random.Random, split: str = "all") -> Problem:
    """One problem of ``level`` drawn with ``rng`` (uniform over the level's problems in ``split``).

    Small pools (level 1 has 100 problems, level 4 about 40) are never split: a held-out tenth
    would leave almost nothing to learn from or to measure.
    """
    lv = get_level(level)
    shared = lv.level in (1, 4)
    for _ in range(10_000):
        if lv.kind == "add":
            lo = 0 if lv.lo == 1 else 10 ** (lv.lo - 1)
            hi = 10**lv.lo - 1
            ops = (rng.randint(lo, hi), rng.randint(lo, hi))
        else:
            ops = (rng.choice(_collatz_pool(lv.lo, lv.hi)),)
        if shared or in_split(ops, split):
            return make_problem(level, ops)
    raise RuntimeError(f"could not draw a {split!r} problem of level {level}")  # unreachable in practice


def generate_problems(level: int, count: int, seed: int, split: str = "test") -> list[Problem]:
    """``count`` problems of ``level``; the same ``(level, count, seed, split)`` gives the same list."""
    rng = random.Random(f"tiny-reasoner/{level}/{seed}/{split}")
    return [sample_problem(level, rng, split) for _ in range(count)]


def sample_mix(mix: dict[int, float], count: int, seed: int, split: str = "test") -> list[Problem]:
    """``count`` problems whose levels are drawn with the weights of ``mix`` (e.g. REALISTIC_MIX)."""
    rng = random.Random(f"tiny-reasoner/mix/{seed}/{split}")
    levels, weights = zip(*sorted(mix.items()))
    return [sample_problem(rng.choices(levels, weights)[0], rng, split) for _ in range(count)]


# ---------------------------------------------------------------- text


def prompt_for(problem: Problem) -> str:
    if problem.kind == "add":
        a, b = problem.operands
        return f"{a}+{b}="
    return f"collatz({problem.operands[0]})="


def _add_chain(a: int, b: int) -> str:
    # Column j (least significant first): "a_j+b_j[+carry]=column sum".
    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0
    for j in range(max(len(da), len(db))):
        x = int(da[j]) if j < len(da) else 0
        y = int(db[j]) if j < len(db) else 0
        s = x + y + carry
        lines.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={s}")
        carry = s // 10
    return ",".join(lines)


def collatz_line(step: int, op: str, x: int) -> str:
    return f"{step:0{COUNTER_WIDTH}d}{op}{str(x)[::-1].ljust(COLLATZ_WIDTH, '0')}\n"


def _collatz_chain(n: int) -> str:
    traj = collatz_trajectory(n)
    if max(traj) >= 10**COLLATZ_WIDTH or len(traj) - 1 >= 10**COUNTER_WIDTH:
        raise ValueError(f"collatz({n}) does not fit the chain format")
    lines = [collatz_line(0, ":", n)]
    for i in range(1, len(traj)):
        lines.append(collatz_line(i, "/" if traj[i - 1] % 2 == 0 else "*", traj[i]))
    return "".join(lines)


def solution_for(problem: Problem) -> str:
    """The worked completion, ``<think>chain</think>answer: N`` (the tokenizer adds EOS)."""
    if problem.kind == "add":
        chain = _add_chain(*problem.operands)
    else:
        chain = _collatz_chain(problem.operands[0])
    return f"{THINK_START}{chain}{THINK_END}{ANSWER_PREFIX}{problem.answer}"


_ANSWER_RE = re.compile(r"answer:\s*(-?\d+)")


def parse_answer(text: str) -> int | None:
    """The integer on the answer line after ``</think>`` (the last one), else ``None``.

    Text without ``</think>`` is parsed whole, so a bare ``answer: 12`` also counts.
    """
    if THINK_END in text:
        text = text.rsplit(THINK_END, 1)[1]
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    return int(matches[-1])
