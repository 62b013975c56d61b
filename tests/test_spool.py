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
