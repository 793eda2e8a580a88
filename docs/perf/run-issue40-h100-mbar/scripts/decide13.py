# Take the 16-bit exchange into the tree when the lab found it exact and faster at 1 x 32K and 64 x 64K.
import json
import sys

c, t = json.load(open("/tmp/lab/lab_checks.json")), json.load(open("/tmp/lab/lab_times.json"))
order = [v for n, v in c["order_checks"].items() if n.startswith("h16")]
conf = [d for s in ("small", "full") for n, d in c[f"conform_{s}"].items() if n.startswith("h16")]
exact = bool(order) and all(v is True for v in order) and len(conf) == 4 and all(not d["bad"] for d in conf)
a, b = t.get("1x32768k512", {}), t.get("64x65536k512", {})
nums = [a.get("h16_4"), a.get("tree4"), b.get("h16_16"), b.get("tree16")]
faster = all(isinstance(x, float) for x in nums) and nums[0] < nums[1] and nums[2] < nums[3]
print("h16 exact", exact, "faster", faster, nums)
sys.exit(0 if exact and faster else 1)
