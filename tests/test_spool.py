"""The outage spool file: order kept, the unsent tail replaced atomically, staging paths unique."""
from tlt.spool import Spool


def test_append_keep_and_clear(tmp_path):
    sp = Spool(tmp_path / "spool", "run1")
    assert not sp.exists() and sp.entries() == []
    for i in range(3):
        sp.append("metrics", {"items": [["loss", float(i), 0, i]]})
    got = sp.entries()
    assert [e["items"][0][1] for e in got] == [0.0, 1.0, 2.0] and {e["kind"] for e in got} == {"metrics"}
    sp.keep(got[1:])  # the first was sent
    assert sp.entries() == got[1:] and not list((tmp_path / "spool").glob("*.tmp"))
    sp.append("terminate", {"status": "FAILED"})
    assert [e["kind"] for e in sp.entries()] == ["metrics", "metrics", "terminate"]
    sp.keep([])
    assert not sp.exists()


def test_stage_paths_are_fresh(tmp_path):
    sp = Spool(tmp_path, "run1")
    a, b = sp.stage("plot.png"), sp.stage("plot.png")
    assert a != b and a.parent.is_dir() and b.parent.is_dir() and a.name == "plot.png"
    assert a.is_relative_to(tmp_path / "run1")


def test_lock_excludes_a_second_writer(tmp_path):
    """Two writers of one run's spool (a run still logging, `tlt tracking sync`) take turns: the
    second waits while the first rewrites the file; the lock file goes with the spool."""
    import threading
    import time

    a, b = Spool(tmp_path, "run1"), Spool(tmp_path, "run1")
    order = []
    with a.locked():
        a.append("metrics", {"items": []})

        def second():
            with b.locked():
                order.append("b")
                b.keep([])

        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("a")  # b is still waiting for the lock
        assert a.lock_path.exists()
    t.join(5)
    assert order == ["a", "b"] and not a.exists() and not a.lock_path.exists()
    with a.locked():  # the lock file is created again on demand
        a.append("tags", {"items": []})
    assert a.lock_path.exists() and [e["kind"] for e in b.entries()] == ["tags"]
