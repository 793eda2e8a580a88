# Bench the tree only if its 1 x 32K cluster time beats both earlier forms in this run's lab.
import json
import sys

c, t = json.load(open("/tmp/lab/lab_checks.json")), json.load(open("/tmp/lab/lab_times.json"))
one = t.get("1x32768k512", {})
ok = all(isinstance(one.get(v), float) for v in ("tree4", "r30_4", "v31_4")) and one["tree4"] < min(
    one["r30_4"], one["v31_4"]
)
print(
    "tree4",
    one.get("tree4"),
    "r30_4",
    one.get("r30_4"),
    "v31_4",
    one.get("v31_4"),
    "bench" if ok else "no bench",
)
sys.exit(0 if ok else 1)
