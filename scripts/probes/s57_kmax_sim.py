# One-off probe (session 57): goodput against plain decoding and every fixed K in the
# closed-loop simulator, K_max 3 or 4. PYTHONPATH=. python scripts/probes/s57_kmax_sim.py 4 "hard_start=16"
import sys
import tests.support.policy_sim as ps
import tests.support.policy_sim_workload as pw
from tests.support.policy_sim_engines import MEASURED
kmax = int(sys.argv[1]); kw = eval("dict(%s)" % sys.argv[2])
ps.K_MAX = kmax
if kmax == 4: pw.PROFILE = (0.73, 0.72, 0.80, 0.82)
res = []
for b in (1, 8, 64):
    out = ps.compare(MEASURED, ps.Workload(b, 2, **kw), noise=ps.Noise(sigma=0.05), seeds=range(8))
    res.append(f"b{b} {out['goodput']/out[0]:.3f}/{out['ratio']:.3f}")
print(kmax, kw, "  ".join(res))
