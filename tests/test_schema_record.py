import pytest

from needlescope.paths import atomic_write_json
from needlescope.schema import check_schema, record


def test_record_requires_every_property_but_the_optional_ones():
    schema = record({"a": {"type": "integer"}, "b": {"type": "string"}}, optional=("b",))
    check_schema({"a": 1}, schema, "x")
    with pytest.raises(ValueError, match="missing key 'a'"):
        check_schema({"b": "s"}, schema, "x")
    with pytest.raises(ValueError, match="optional names no property"):
        record({"a": {}}, optional=("c",))


def test_atomic_write_json_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "v.json"
    atomic_write_json(path, {"n": 1})
    atomic_write_json(path, {"n": 2})
    assert path.read_text() == '{\n "n": 2\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["v.json"]
