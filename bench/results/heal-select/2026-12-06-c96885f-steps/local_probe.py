"""Probe: each pruned block's MLP trained locally (Adam, E epochs) to reproduce the dense block's MLP
output on the dense model's own MLP inputs, before the heal. Writes the locally trained student as a
package copy (--out), to be healed and scored by bench/heal_select.py like any other student.

    python local_probe.py --student out/sel-student --out out/sel-student-local --epochs 4
"""
import argparse
import json
import shutil
import time

import torch
import torch.nn.functional as F

from optimizer import data, load
from optimizer.sequential import calibration_dtype

ap = argparse.ArgumentParser()
ap.add_argument("--student", default="out/sel-student")
ap.add_argument("--out", required=True)
ap.add_argument("--windows", type=int, default=32, help="1024-token windows of the heal text (mix)")
ap.add_argument("--epochs", type=int, default=4)
ap.add_argument("--lr", type=float, default=2e-4)
ap.add_argument("--batch", type=int, default=1024, help="tokens a step")
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
teacher, tok = load.load_model(load.resolve(None))
student, _ = load.load_model(load.resolve(a.student))
dtype = calibration_dtype("auto")

wiki = data.builtin_text("calib").text
train = [data.token_windows(tok, wiki[: wiki.rfind("\n", 0, int(len(wiki) * 0.97))], 1024)]
for name in data.HEAL_SAMPLES:
    first, _ = data.split_sample(data.builtin_sample(name).read_text())
    train.append(data.token_windows(tok, first, 1024))
train = torch.cat(train)
# not the heal's order (heal_select shuffles with seed 0): another seed, so the windows differ in part
train = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(1))][: a.windows]

started = time.time()
layers_t, layers_s = teacher.model.layers, student.model.layers
inputs = [[] for _ in layers_t]
hooks = [l.mlp.register_forward_hook(lambda m, args, out, i=i: inputs[i].append(args[0].detach().flatten(0, 1).to(torch.bfloat16)))
         for i, l in enumerate(layers_t)]
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
    for w in train:
        teacher.model(w[None], use_cache=False)
for h in hooks:
    h.remove()
collect_s = time.time() - started
log = []
for i, (lt, ls) in enumerate(zip(layers_t, layers_s)):
    x = torch.cat(inputs[i]).float()
    inputs[i] = None
    with torch.no_grad():
        y = torch.cat([lt.mlp(c) for c in x.split(4096)])
    norm = y.pow(2).mean()
    mlp = ls.mlp
    params = [p for p in mlp.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=a.lr)
    steps = a.epochs * (len(x) // a.batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=a.lr / 30)

    def err():
        with torch.no_grad():
            return float(sum(F.mse_loss(mlp(c), t, reduction="sum") for c, t in zip(x.split(4096), y.split(4096))) / y.numel() / norm)
    before = err()
    g = torch.Generator().manual_seed(i)
    for _ in range(a.epochs):
        for idx in torch.randperm(len(x), generator=g).split(a.batch):
            if len(idx) < a.batch:
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = mlp(x[idx])
            loss = F.mse_loss(out.float(), y[idx]) / norm
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    for p in params:
        p.requires_grad_(False)
    after = err()
    log.append({"block": i, "rel_err_before": round(before, 5), "rel_err_after": round(after, 5)})
    print(f"block {i}: relative MLP error {before:.4f} -> {after:.4f}, {time.time() - started:.0f} s", flush=True)

shutil.copytree(a.student, a.out)
student.to(torch.bfloat16).save_pretrained(a.out)
json.dump({"args": vars(a), "collect_s": round(collect_s), "wall_s": round(time.time() - started), "blocks": log},
          open(f"{a.out}/local_probe.json", "w"), indent=1)
