import pandas as pd

from tlt.rl.sampler import PromptSampler


def _rows(n):
    return pd.DataFrame({"id": [f"r{i}" for i in range(n)], "prompt": [f"p{i}" for i in range(n)]})


def test_every_row_once_per_epoch():
    s = PromptSampler(_rows(10), seed=3)
    seen = [r for _ in range(5) for r in s.next(2)["id"]]
    assert sorted(seen) == sorted(f"r{i}" for i in range(10))


def test_resume_from_state_gives_same_sequence():
    a = PromptSampler(_rows(7), seed=1)
    a.next(3), a.next(3)
    state = a.state()
    expected = [list(a.next(3)["id"]) for _ in range(4)]
    b = PromptSampler(_rows(7), seed=1)
    b.load_state(state)
    assert [list(b.next(3)["id"]) for _ in range(4)] == expected


def test_batches_span_epochs():
    s = PromptSampler(_rows(3), seed=0)
    assert len(s.next(5)) == 5 and s.epoch == 1
