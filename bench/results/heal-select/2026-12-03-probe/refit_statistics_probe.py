import time, torch, json
from optimizer import load, data
from optimizer.adapters import get_adapter, BlockShape
from optimizer.methods.activation import ActivationImportance
from optimizer.refit import Refit, refit_masks
from optimizer.masks import Masks, BlockMask
from optimizer.surgery import masked, prune
from optimizer.heal import kd_eval
from optimizer.structured import mean_loss
torch.set_num_threads(2); torch.manual_seed(0)
model, tok = load.load_model(load.resolve(None))
adapter = get_adapter(model.config)
wins = data.token_windows(tok, data.builtin_text("calib").text, 2048)
train, held = wins[:-1], wins[-1:]
SAMPLES = ("tiny.utf8", "technical.utf8", "code.utf8", "multilingual.utf8")
wiki = data.builtin_text("calib").text
hk = {"wiki_heldout": data.token_windows(tok, wiki, 1024)[-2:]}
for name in SAMPLES:
    text = data.builtin_sample(name).read_text(); cut = text.rfind("\n", 0, int(len(text) * 0.9)) + 1
    hk[name] = data.token_windows(tok, text[cut:], 1024)[:2]
imp = ActivationImportance(model, adapter)
grams = []
for block in adapter.blocks(model):
    down = adapter.mlp(block).down
    fit = Refit(down, None)
    grams.append(fit)
    imp._handles.append(down.register_forward_pre_hook(lambda m, a, f=fit: f.add_batch(a[0])))
t = time.time()
for w in train[:16]:
    imp.observe(w[None])
imp.close()
print("importance+gram pass", time.time() - t)
masks = imp.decide(BlockShape(9, 3, 896))
def ds_refit(masks, damp=0.1):
    out = []
    for bm, fit in zip(masks.blocks, grams):
        fit.keep = torch.tensor(bm.channels)
        nb = BlockMask(bm.heads, bm.kv_heads, bm.channels)
        nb.down_columns = fit.solve(damp)
        out.append(nb)
    return Masks(out)
res = {}
def score(name, m):
    with masked(model, adapter, m):
        hl = mean_loss(model, held)
    pruned = prune(model, adapter, m)
    kl = {k: round(kd_eval(pruned, model, v), 4) for k, v in hk.items()}
    res[name] = {"held_out_loss": round(hl, 4), "kl": kl, "kl_mean": round(sum(kl.values()) / len(kl), 4)}
    print(name, res[name], flush=True)
score("oneshot", masks)
t = time.time(); m = ds_refit(masks); print("ds solve", time.time() - t)
score("dense_stream_refit16", m)
for damp in (0.03, 0.3):
    score(f"dense_stream_refit16_damp{damp}", ds_refit(masks, damp))
t = time.time(); m = refit_masks(model, adapter, masks, train[:16], 0.1); print("seq refit16", time.time() - t)
score("seq_refit16", m)
json.dump(res, open("/tmp/probe/dense_stream_refit.json", "w"), indent=1)
