# one-off probe (removed in a later commit): SPECSERVE_PROBE_NOGATE=1 turns the mode gate off;
# SPECSERVE_PROBE_DUMP=dir writes the goodput policy's decisions, cost tables and mode rates
# there whenever the engine's stats are read (every metrics scrape).
import json
import os

_dump = os.environ.get("SPECSERVE_PROBE_DUMP")
if os.environ.get("SPECSERVE_PROBE_NOGATE") or _dump:
    try:
        from specserve.speculative import mode_rates, speculator

        if os.environ.get("SPECSERVE_PROBE_NOGATE"):
            mode_rates.ModeRates.MIN_STEPS = 10**9
        if _dump:
            _stats = speculator.Speculator.stats

            def stats(self):
                out = _stats(self)
                p = self.policy
                if hasattr(p, "modes"):
                    data = {
                        "decisions": p.trace.dump()[-3000:],
                        "cost": p.cost.snapshot(),
                        "modes": p.modes.snapshot(),
                        "held": p.modes.num_held,
                        "dormant": p.dormant,
                    }
                    with open(os.path.join(_dump, f"trace_{os.getpid()}.json"), "w") as f:
                        json.dump(data, f)
                return out

            speculator.Speculator.stats = stats
    except Exception as e:  # noqa: BLE001
        print("probe sitecustomize failed:", e)
