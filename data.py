"""Prompt data: (chat messages, reference answer) records for training and evaluation.

A record is a plain dict ``{"messages": [{"role": "user", "content": ...}], "answer": "..."}``; the trainer applies
the tokenizer's chat template to ``messages`` and the reward (reward.py) compares the completion's final answer
with ``answer``. The paper (shared/PAPER.md §4) trains on DAPO-Math-17k + MATH levels 3-5 with the DAPO prompt,
which asks for a final line ``Answer: $Answer``.

The synthetic arithmetic task below is the embedded default: it needs no network, is unlimited and seeded, and its
answers use the same ``Answer: ...`` final-answer format, so the same reward code scores it.

    python data.py                      # print a few synthetic examples of each level
"""

import random
import zlib

# --- the synthetic arithmetic task -------------------------------------------------------------------------------
# level -> (operators, digits of a, digits of b). Level 1 is easy for the tiny model, level 4 hard.
LEVELS = {
    1: ("+-", 2, 2),  # 47+38, 91-56
    2: ("+-", 3, 3),  # 472+385
    3: ("*", 2, 1),   # 47*8
    4: ("*", 2, 2),   # 47*38
}
HELDOUT_MOD = 10      # a problem is held out iff crc32 of its text % HELDOUT_MOD == 0: ~10% of every level, fixed


def _number(rng, digits):
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _is_heldout(text):
    # A hash of the problem text, not of the seed, so train and held-out are disjoint for every seed and level.
    return zlib.crc32(text.encode()) % HELDOUT_MOD == 0


def arithmetic_problem(rng, level):
    """One problem of `level` as (text, answer), e.g. ("472+385", "857")."""
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; known levels: {sorted(LEVELS)}")
    ops, da, db = LEVELS[level]
    op = rng.choice(ops)
    a, b = _number(rng, da), _number(rng, db)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}", str(value)


def arithmetic(n, *, split="train", levels=(1, 2, 3), seed=0):
    """`n` records of the synthetic task (levels drawn uniformly), seeded; `split` is "train" or "test".

    The test split is the fixed held-out part of the problem space (see `_is_heldout`): a train record never
    equals a test record, whatever the seeds.
    """
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    rng = random.Random(f"arithmetic-{split}-{seed}")
    records = []
    while len(records) < n:
        text, answer = arithmetic_problem(rng, rng.choice(levels))
        if _is_heldout(text) == (split == "test"):
            records.append({"messages": [{"role": "user", "content": text}], "answer": answer})
    return records


def arithmetic_response(answer):
    """The completion a perfect policy writes for the synthetic task (used for the supervised warm start)."""
    return f"Answer: {answer}"


def main():
    for level in LEVELS:
        rng = random.Random(0)
        print(level, [arithmetic_problem(rng, level) for _ in range(4)])
    print(arithmetic(3, split="test"))


if __name__ == "__main__":
    main()
