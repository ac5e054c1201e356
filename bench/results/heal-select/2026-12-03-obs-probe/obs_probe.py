"""Probe (not product code): which MLP channels to keep at the default 0.7 shape, chosen with the
refit in mind.

The default keeps, per block, the channels with the largest Σ_t a_tj² ‖W_down[:, j]‖² (activation
importance: what each channel contributes alone) and then refits the kept down_proj columns by
least squares. Optimal-brain-surgeon selection instead removes, one at a time, the channel whose
removal *after the others compensate* costs least: ‖W[:, j]‖² / [G⁻¹]_jj, then updates W and G⁻¹
(SparseGPT's / ZipLM's structured step), G = the down_proj inputs' Gram matrix the refit already
gathers. Both are refitted the same way afterwards.

Scored where the reported figures cannot see: the KL to the dense model on held-out windows of the
calibration half and of exllamav2's tiny / technical / code / multilingual samples (as
bench/heal_select.py), and the zero-shot mean with seed 4321.

    PYTHONPATH=. .venv/bin/python bench/results/heal-select/2026-12-03-obs-probe/obs_probe.py --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/
import benchlib  # noqa: E402
from heal_select import SAMPLES, SELECTION_SEED  # noqa: E402

from optimizer import data, load, zeroshot  # noqa: E402
from optimizer.adapters import BlockShape, get_adapter  # noqa: E402
from optimizer.heal import kd_eval  # noqa: E402
from optimizer.masks import BlockMask, Masks  # noqa: E402
from optimizer.methods.activation import ActivationImportance  # noqa: E402
from optimizer.refit import RefitStatistics, refit_masks  # noqa: E402
from optimizer.surgery import masked  # noqa: E402


@torch.no_grad()
def obs_keep(gram: torch.Tensor, w: torch.Tensor, n_keep: int, percdamp: float = 0.01) -> list[int]:
    """Greedy OBS column removal: the kept columns of `w` [out, in] after removing in - n_keep."""
    G = gram.double().clone()
    G += percdamp * G.diagonal().mean() * torch.eye(len(G), dtype=G.dtype)
    Hinv = torch.linalg.inv(G)
    W = w.double().clone()
    alive = torch.ones(len(G), dtype=torch.bool)
    for _ in range(len(G) - n_keep):
        d = Hinv.diagonal()
        sal = W.pow(2).sum(0) / d
        sal[~alive] = float("inf")
        j = int(sal.argmin())
        W -= torch.outer(W[:, j], Hinv[j, :]) / Hinv[j, j]
        Hinv -= torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
        Hinv[j, j] = 1.0  # removed: its row and column are zero now; keep the diagonal finite
        alive[j] = False
    return alive.nonzero().flatten().tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--zeroshot", type=int, default=300)
    ap.add_argument("--calib-windows", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(__file__).resolve().parent
    teacher, tok = load.load_model(load.resolve(None))
    adapter = get_adapter(teacher.config)
    calib = data.token_windows(tok, data.builtin_text("calib").text, 2048)[:-1][: a.calib_windows]

    wiki = data.builtin_text("calib").text
    held = {"wiki_heldout": data.token_windows(tok, wiki, 1024)[-2:]}
    for name in SAMPLES:
        text = data.builtin_sample(name).read_text()
        cut = text.rfind("\n", 0, int(len(text) * 0.9)) + 1
        held[name] = data.token_windows(tok, text[cut:], 1024)[:2]

    t0 = time.time()
    imp = ActivationImportance(teacher, adapter)
    grams = RefitStatistics(teacher, adapter)
    with torch.inference_mode():
        for i, w in enumerate(calib):
            imp.observe(w[None])
            print(f"calibration window {i + 1}/{len(calib)}, {time.time() - t0:.0f} s", flush=True)
    imp.close(), grams.close()
    result = {"calib_windows": len(calib), "calib_s": round(time.time() - t0), **benchlib.run_info(), "variants": {}}

    shape = BlockShape(num_heads=9, num_kv_heads=3, intermediate_size=896)  # the default job's choice at 0.7
    activation = imp.decide(shape)
    t0 = time.time()
    obs = Masks([BlockMask(bm.heads, bm.kv_heads, obs_keep(g.gram, g.linear.weight.detach(), shape.intermediate_size))
                 for bm, g in zip(activation.blocks, grams.down)])
    obs_s = round(time.time() - t0)
    overlap = sum(len(set(x.channels) & set(y.channels)) for x, y in zip(activation.blocks, obs.blocks)) / (
        len(activation.blocks) * shape.intermediate_size)
    result.update(obs_select_s=obs_s, channel_overlap=round(overlap, 3))
    print(f"OBS selection {obs_s} s; channels shared with the activation choice: {overlap:.1%}", flush=True)

    for name, masks in (("activation", activation), ("obs", obs)):
        for refit in (False, True):
            m = refit_masks(grams, teacher, adapter, masks, damp=0.1) if refit else masks
            student = copy.deepcopy(teacher)
            with masked(student, adapter, m):
                kls = {k: round(kd_eval(student, teacher, v), 4) for k, v in held.items()}
                row = {"held_out_kl": kls, "held_out_kl_mean": round(sum(kls.values()) / len(kls), 4)}
                if refit and a.zeroshot:
                    row["zeroshot"] = zeroshot.evaluate(student, tok, ["arc_easy", "piqa", "hellaswag"], a.zeroshot,
                                                        SELECTION_SEED)["mean"]
            key = f"{name}{' + refit' if refit else ''}"
            result["variants"][key] = row
            print(key, json.dumps(row), flush=True)
            del student
    benchlib.write_result(benchlib.new_file(out / "obs.json"), result)


if __name__ == "__main__":
    main()
