"""`optimize` with its one-shot statistics read from the default heal text's kinds, not Wikipedia alone.

    python calib_student.py WIKI EACH -- OPTIMIZE_ARGS...

The structured method reads the first --calib-windows (16) windows of the calibration text for its
importance and its refit (structured.py); with the built-in corpus those are the first 32k tokens of
the Wikipedia half. This puts WIKI of them first, then EACH window of the first 90% of each of
exllamav2's tiny / technical / code / multilingual samples (the default heal text's other kinds;
their last 10% are the probe's held-out windows, never read here), then the rest of Wikipedia. The
held-out calibration window (shape choice, the refit's check) stays the Wikipedia half's last.
"""
import sys

import torch

from optimizer import data
from optimizer.cli import optimize
from optimizer.job import Job

wiki, each = map(int, sys.argv[1:3])
assert sys.argv[3] == "--"
calibrate = Job.calibrate


def mixed(self):
    calib = calibrate(self)
    seq = calib.train.shape[1]
    others = [data.token_windows(self.tok, text, seq)[:each] for text in data.builtin_heal_samples().values()]
    calib.train = torch.cat([calib.train[:wiki], *others, calib.train[wiki:]])
    self.log(f"calibration (probe): {wiki} Wikipedia windows, then {each} of each of "
             f"{', '.join(data.builtin_heal_samples())}, then the rest")
    return calib


Job.calibrate = mixed
optimize.main(sys.argv[4:], prog_name="optimize")
