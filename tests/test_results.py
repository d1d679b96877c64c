import json

from bfexp import results


def test_json_written_atomically_and_nan_becomes_null(tmp_path):
    path = tmp_path / "summary.json"
    results.write_json_atomic(path, {"a": 1.5, "b": float("nan")})
    assert json.loads(path.read_text()) == {"a": 1.5, "b": None}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"], "no temp files left"


def test_tail_returns_whole_records_only(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = results.JsonlTail(path)
    assert tail.read_new() == []
    results.append_jsonl(path, {"step": 1})
    with open(path, "a") as f:
        f.write('{"step": 2')  # torn: a writer is mid-line
    assert tail.read_new() == [{"step": 1}]
    with open(path, "a") as f:
        f.write("}\n")
    assert tail.read_new() == [{"step": 2}]
    assert results.read_jsonl(path) == [{"step": 1}, {"step": 2}]
