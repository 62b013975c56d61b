"""The lenient math reward conf/longtail.yaml scores with (`rl.reward: math`), on SmolLM2-135M's own
step-by-step answers (bench/longtail.py, T=0.7): an explicit \\boxed{} decides alone; without one,
math-verify on the whole text, then the last number. A strict boxed-only extractor would score the unboxed
right answers 0, leaving GRPO groups with no signal (measured on SmolLM2-135M)."""
from __future__ import annotations

import pytest

from tlt.rl.rewards import get_reward_fn

STEPS_RIGHT_BOXED = "Step 1: 8 * -1 = -8.\n\nThe final answer is \\boxed{-8}."
STEPS_WRONG_BOXED = "To solve for \\boxed{8}, we need to follow these steps:\n\n1. Multiply \\boxed{8} by 10 to get 8."
STEPS_LAST_NUMBER = ("Step 1: To find -1 / 1, we need to simplify the fraction.\n-1 / 1 = -1\n\n"
                     "Step 2: combine the numerators and the denominator:\n-1 / 1 + (-1) = -1\n\n"
                     "So, the final answer is -1.")
STEPS_WRONG_LAST = "1. Multiply 8 by -1: 8 * -1 = -8\n2. Add -1 to 8: 8 + 1 = 9\n\nSo, the final answer is 9."
JUNK = "Here is the code:\n\n```python\ndef calculate_integer_add():\n    result = x\n"


@pytest.mark.parametrize("completion, gold, expected", [
    (STEPS_RIGHT_BOXED, "-8", 1.0),
    ("The answer is $\\boxed{42}$, not 41.", "42", 1.0),
    (STEPS_WRONG_BOXED, "-8", 0.0),                 # a boxed answer decides alone, even when wrong
    ("\\boxed{7} although some say 72", "72", 0.0),
    (STEPS_LAST_NUMBER, "-1", 1.0),                 # no \boxed{}: the last number is the answer
    ("1. Add 0 + 7 = 0\n2. 7 + 0 = 7\n\nSo, you can calculate 0 + 7 as 7.", "7", 1.0),
    (STEPS_WRONG_LAST, "-8", 0.0),                  # the right number in the working does not count
    (JUNK, "-8", 0.0),
    ("", "3", 0.0),
])
def test_lenient_math_reward_on_step_by_step_answers(completion, gold, expected):
    assert get_reward_fn("math")([completion], [gold]) == [expected]


def test_lenient_reward_accepts_the_pipeline_keywords():
    """The RL step passes tasks= and metas=; `math` ignores them and scores the text alone."""
    out = get_reward_fn("math")([STEPS_LAST_NUMBER, JUNK], ["-1", "-8"], tasks=["basic_arithmetic"] * 2,
                                metas=["{}", "{}"])
    assert out == [1.0, 0.0]
