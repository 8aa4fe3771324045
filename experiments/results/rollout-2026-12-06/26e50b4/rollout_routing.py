"""bench/rollout.py under a routing variant: python rollout_routing.py VARIANT -- rollout args..."""
import runpy
import sys

from jetrl.quant.kernels import tuning

variant = sys.argv[1]
bounds = dict(tuning.current().decode_max_m_by_shape)
if variant == "no-grouped-05":  # the 0.5B q/k/v back on the general bound (stacked cuBLAS above 64 rows)
    bounds.pop(("grouped", 1152, 896))
elif variant == "gate-up-128":
    bounds[("grouped", 9728, 896)] = 128
elif variant == "no-05":
    for key in [("grouped", 1152, 896), (896, 896), (896, 4864)]:
        bounds.pop(key)
sys.argv = ["bench/rollout.py"] + sys.argv[3:]
with tuning.override(decode_max_m_by_shape=bounds):
    print("routing variant", variant, sorted(map(str, tuning.current().decode_max_m_by_shape.items())), flush=True)
    runpy.run_path("bench/rollout.py", run_name="__main__")
