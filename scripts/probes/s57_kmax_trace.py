# One-off probe (session 57): each decision of goodput at 48+ requests with its goodput per K,
# tokens a request, periods and cell counts. PYTHONPATH=. python scripts/probes/s57_kmax_trace.py 3 64 0 "hard_start=0"
import sys
import tests.support.policy_sim as ps
import tests.support.policy_sim_workload as pw
from tests.support.policy_sim_engines import MEASURED
from specserve.speculative.goodput_policy import GoodputPolicy
kmax = int(sys.argv[1]); b = int(sys.argv[2]); seed = int(sys.argv[3]); kw = eval("dict(%s)" % sys.argv[4])
ps.K_MAX = kmax
if kmax == 4: pw.PROFILE = (0.73, 0.72, 0.80, 0.82)
orig = GoodputPolicy.choose
step = [0]
def choose(self, reqs, *a):
    held0 = self.trace.settled_steps; dorm = self.dormant
    out = orig(self, reqs, *a)
    n = len(reqs); step[0] += 1
    if n >= 48 and out:
        k = max(out)
        c = "held" if self.trace.settled_steps != held0 else "probe" if self._running_k is None else "chosen"
        per, raw, cells = self.cost.period_table(n, kmax)
        cums = self.acceptance.cumulatives([r.request_id for r in reqs])
        tok = [sum(col) for col in zip(*cums)][: kmax + 1]
        g = [t / p for t, p in zip(tok, per)]
        print(f"{step[0]:5d} n={n} k={k} {c:6s} dorm={int(dorm)} g=" + ",".join(f"{x:.1f}" for x in g) + " tok/req=" + ",".join(f"{t/n:.2f}" for t in tok) + " per=" + ",".join(f"{x:.2f}" for x in per) + " cnt=" + ",".join(str(c.count) if c else "-" for c in cells))
    return out
GoodputPolicy.choose = choose
ps.simulate("goodput", MEASURED, ps.Workload(b, 2, **kw), seed, ps.Noise(sigma=0.05))
