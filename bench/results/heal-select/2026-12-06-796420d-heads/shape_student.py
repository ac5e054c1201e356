"""`optimize` with its uniform shape fixed: the probe's students of other head counts.

    python shape_student.py HEADS KV CHANNELS -- OPTIMIZE_ARGS...

`optimize` chooses among a few regular shapes the one that loses least on the held-out
calibration window before any healing (optimizer/budget.py, structured.choose_uniform); this
puts one shape in that list, so the rest of the job (masks, refit, surgery, export) is the
product's.
"""
import sys

from optimizer import budget
from optimizer.adapters import BlockShape
from optimizer.cli import optimize

heads, kv, channels = map(int, sys.argv[1:4])
assert sys.argv[4] == "--"
budget.uniform_candidates = lambda *a, **k: [BlockShape(heads, kv, channels)]
optimize.main(sys.argv[5:], prog_name="optimize")
