# Take lab form V (argv[1], e.g. mbar: variants V4 / V16 or V8) into the tree when the lab found it exact and faster at 1 x 32K.
import json
import sys

V = sys.argv[1] if len(sys.argv) > 1 else "gather"
c, t = json.load(open("/tmp/lab/lab_checks.json")), json.load(open("/tmp/lab/lab_times.json"))
order = [v for n, v in c["order_checks"].items() if n.startswith(V)]
conf = [d for s in ("small", "full") for n, d in c[f"conform_{s}"].items() if n.startswith(V)]
exact = bool(order) and all(v is True for v in order) and len(conf) == 4 and all(not d["bad"] for d in conf)
one = t.get("1x32768k512", {})
faster = (
    isinstance(one.get(V + "4"), float)
    and isinstance(one.get("pull4"), float)
    and one[V + "4"] < one["pull4"]
)
print(V, "exact", exact, "faster", faster, one.get(V + "4"), one.get("pull4"))
sys.exit(0 if exact and faster else 1)
