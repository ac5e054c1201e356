"""Probe (issue 25): whole blocks removed as one contiguous run instead of one by one.

Gromov et al. ("The Unreasonable Ineffectiveness of the Deeper Layers") remove the n consecutive
blocks l .. l+n-1 whose input and output are most alike: the smallest angular distance
arccos(cos(h_l, h_{l+n})) / pi, here the token mean over 8 x 512 tokens of the calibration half
(the windows bench/results/heal-select/2026-12-04-depth/depth_probe.py reads). n = 9 of 30 blocks,
the first and the last never removed (as optimizer/depth.py). Writes the unhealed student to
out/depth-probe/chunk for bench/heal_select.py and the distances to chunk-blocks.json.

    PYTHONPATH=.:bench .venv/bin/python bench/results/heal-select/2026-12-05-mixed/chunk_probe.py
"""
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from optimizer import data, load  # noqa: E402
from optimizer.adapters import get_adapter  # noqa: E402
from optimizer.depth import remove_blocks  # noqa: E402

HERE = Path(__file__).parent
DROP = 9
torch.set_num_threads(1)
teacher, tok = load.load_model(load.resolve(None))
teacher.eval()
wiki = data.builtin_text("calib").text
calib = data.token_windows(tok, wiki[: wiki.rfind("\n", 0, int(len(wiki) * 0.97))], 512)
calib = calib[torch.randperm(len(calib), generator=torch.Generator().manual_seed(1))][:8]

with torch.no_grad():
    hs = [h.float() for h in teacher(calib, output_hidden_states=True, use_cache=False).hidden_states]
L = teacher.config.num_hidden_layers
# hidden_states[l] is block l's input; removing blocks l .. l+DROP-1 feeds hidden_states[l] to block l+DROP
distance = {l: float(torch.arccos(torch.nn.functional.cosine_similarity(hs[l], hs[l + DROP], dim=-1)
                                  .clamp(-1, 1)).mean() / math.pi)
            for l in range(1, L - DROP)}  # block 0 and block L-1 stay
start = min(distance, key=distance.get)
removed = list(range(start, start + DROP))
keep = [i for i in range(L) if i not in removed]
student = remove_blocks(teacher, get_adapter(teacher.config), keep)
pkg = Path("out/depth-probe/chunk")
student.save_pretrained(pkg)
tok.save_pretrained(pkg)
(HERE / "chunk-blocks.json").write_text(json.dumps({"angular_distance": {str(k): round(v, 4) for k, v in distance.items()},
                                             "removed": removed, "keep": keep}, indent=1) + "\n")
print("removed", removed, {k: round(v, 3) for k, v in distance.items()})
