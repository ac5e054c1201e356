"""Which 0.7 shape would a prose held-out choose? (run at df4cc1f; its output: shape-diag.json) The product's shape candidates scored on the
held-out window (as the product does) and, beside it, on three prose windows of the calibration
half before it (windows -5..-3; not statistics windows) -- a diagnostic, not a selection."""
import json, sys
from optimizer import structured
from optimizer.cli import optimize
orig = structured.mean_loss
rows = []
def mean_loss(model, windows):
    loss = orig(model, windows)
    job = structured._JOB
    rows.append({"held_out": round(loss, 4), "prose": round(orig(model, job.calib.train[-4:-1]), 4)})
    print("DIAG", rows[-1], flush=True)
    return loss
structured.mean_loss = mean_loss
orig_choose = structured.choose_uniform
def choose(job, method, costs, candidates=None):
    structured._JOB = job
    out = orig_choose(job, method, costs, candidates)
    for r, t in zip(rows, out[3]):
        r["shape"] = t["shape"]; r["retain"] = round(t["retain"], 3)
    print("DIAGTABLE", json.dumps(rows), flush=True)
    return out
structured.choose_uniform = choose
optimize.main(sys.argv[1:], prog_name="optimize")
