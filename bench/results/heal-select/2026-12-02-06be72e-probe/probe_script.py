"""Heal-setting probe (selection): one-shot 0.7 student, heal variants, select on held-out KL of
non-WikiText text and zero-shot seed 4321 (not the reported 1234)."""
import argparse, json, time, torch
from pathlib import Path
from optimizer import load, data, zeroshot, evaluate
from optimizer.heal import Distillation, HealConfig, kd_eval
ap = argparse.ArgumentParser()
ap.add_argument("name"); ap.add_argument("--lr", type=float, default=1e-4); ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--seq", type=int, default=512); ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--data", default="wiki"); ap.add_argument("--lr-end", type=float, default=None)
ap.add_argument("--student", default="/tmp/probe/oneshot"); ap.add_argument("--zs", type=int, default=150)
a = ap.parse_args()
torch.set_num_threads(2); torch.manual_seed(0)
D = Path(".venv/lib/python3.11/site-packages/exllamav2/conversion/standard_cal_data")
teacher, tok = load.load_model(load.resolve(None))
student, _ = load.load_model(load.resolve(a.student))
def split(name):  # train 90%, held-out last 10%
    t = (D / name).read_text(); cut = t.rfind("\n", 0, int(len(t) * 0.9)) + 1
    return t[:cut], t[cut:]
wiki = data.builtin_text("calib").text
held = {"wiki_heldout": data.token_windows(tok, wiki, 1024)[-2:]}
train_texts = {"wiki": [wiki[: wiki.rfind("\n", 0, int(len(wiki) * 0.97))]]}
extra = {}
for f in ("tiny.utf8", "technical.utf8", "code.utf8", "multilingual.utf8"):
    tr, ho = split(f); extra[f] = tr
    held[f] = data.token_windows(tok, ho, 1024)[:2]
train = data.token_windows(tok, train_texts["wiki"][0], a.seq)
if a.data == "mix":
    parts = [train] + [data.token_windows(tok, t, a.seq) for t in extra.values()]
    train = torch.cat(parts)
g = torch.Generator().manual_seed(0)
train = train[torch.randperm(len(train), generator=g)]
cfg = HealConfig(steps=a.steps, lr=a.lr, lr_end=a.lr_end if a.lr_end is not None else a.lr / 10, dtype="bfloat16")
res = {"args": vars(a), "train_seqs": len(train)}
def kls(m): return {k: round(kd_eval(m, teacher, v), 4) for k, v in held.items()}
res["before"] = kls(student)
d = Distillation(student, teacher, cfg)
t0 = time.time()
for i in range(a.steps):
    st = d.step(train[(i * a.batch) % len(train):][: a.batch])
    if i % 5 == 0: print(i, round(st["kd"], 3), round(time.time() - t0), flush=True)
d.close(); res["heal_s"] = round(time.time() - t0)
res["after"] = kls(student)
res["after_mean"] = sum(res["after"].values()) / len(held)
if a.zs:
    z = zeroshot.evaluate(student, tok, ["arc_easy", "piqa", "hellaswag"], a.zs, 4321)
    res["zeroshot"] = z.get("mean", z)
print(json.dumps(res, indent=1, default=str))
Path(f"/tmp/probe/{a.name}.json").write_text(json.dumps(res, indent=1, default=str))
