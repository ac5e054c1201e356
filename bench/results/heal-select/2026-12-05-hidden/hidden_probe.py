"""Probe (issue 25): at the same block parameters (retain ~0.69 of SmolLM2-135M's), does pruning hidden
(embedding) channels too, and fewer MLP channels, keep more than narrowing the MLP alone (the default)?
Pruning the hidden size also shrinks the tied embedding / LM head, which no block pruning touches.

Input: an unhealed width student made by the product (`optimize --retain R --no-heal --quant none`, R
chosen so that R × HIDDEN / 576 is the default's achieved 0.688). Every block weight reads or writes the
residual stream, so keeping HIDDEN of its channels scales every block's parameters by HIDDEN / 576.
Channels kept: the HIDDEN with the largest sum over every RMSNorm (attention, MLP, final) of the
student's mean |norm output| on 8 × 512 calibration tokens (Minitron's embedding-channel importance).
Each RMSNorm then normalises over fewer channels; its weight is multiplied by the token mean of
rms(kept) / rms(all) of its input, so that the kept channels' outputs keep their scale on average.

    PYTHONPATH=.:bench .venv/bin/python bench/results/heal-select/2026-12-05-hidden/hidden_probe.py STUDENT OUT --hidden 540   # a multiple of the 9 heads: transformers refuses others

Writes OUT (a stock LlamaForCausalLM with hidden_size HIDDEN, the tokenizer beside it) and OUT/hidden.json.
"""
import argparse
import json
from pathlib import Path

import torch

from optimizer import data, load

ap = argparse.ArgumentParser()
ap.add_argument("student")
ap.add_argument("out")
ap.add_argument("--hidden", type=int, default=540)
a = ap.parse_args()
torch.set_num_threads(2)
model, tok = load.load_model(load.resolve(a.student))
config = model.config
assert config.model_type == "llama" and config.tie_word_embeddings, "the probe handles a tied Llama only"
wiki = data.builtin_text("calib").text
calib = data.token_windows(tok, wiki[: wiki.rfind("\n", 0, int(len(wiki) * 0.97))], 512)
calib = calib[torch.randperm(len(calib), generator=torch.Generator().manual_seed(1))][:8]

norms = {}
for i, layer in enumerate(model.model.layers):
    norms[f"layers.{i}.input_layernorm"] = layer.input_layernorm
    norms[f"layers.{i}.post_attention_layernorm"] = layer.post_attention_layernorm
norms["norm"] = model.model.norm
score = torch.zeros(config.hidden_size, dtype=torch.float64)
inputs = {name: [] for name in norms}  # each norm's input, for the rms ratio once the channels are known
hooks = []
for name, m in norms.items():
    def hook(mod, args, out, name=name):
        global score
        score += out.detach().abs().double().mean(dim=(0, 1))
        inputs[name].append(args[0].detach().float().reshape(-1, args[0].shape[-1]))
    hooks.append(m.register_forward_hook(hook))
with torch.no_grad():
    for w in calib:
        model(w[None], use_cache=False)
for h in hooks:
    h.remove()
keep = torch.sort(torch.topk(score, a.hidden).indices).values
ratios = {}
for name, xs in inputs.items():
    x = torch.cat(xs)
    ratios[name] = float((x[:, keep].pow(2).mean(-1).sqrt() / x.pow(2).mean(-1).sqrt()).mean())

with torch.no_grad():
    emb = model.model.embed_tokens
    emb.weight = torch.nn.Parameter(emb.weight[:, keep].clone())
    for name, m in norms.items():
        m.weight = torch.nn.Parameter(m.weight[keep].clone() * ratios[name])
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for lin in (at.q_proj, at.k_proj, at.v_proj, mlp.gate_proj, mlp.up_proj):
            lin.weight = torch.nn.Parameter(lin.weight[:, keep].clone())
            lin.in_features = a.hidden
        for lin in (at.o_proj, mlp.down_proj):
            lin.weight = torch.nn.Parameter(lin.weight[keep].clone())
            lin.out_features = a.hidden
    model.lm_head.weight = model.model.embed_tokens.weight
    config.hidden_size = a.hidden
out = Path(a.out)
model.save_pretrained(out)
tok.save_pretrained(out)
block = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and "layernorm" not in n)
info = {"student": a.student, "hidden": a.hidden, "kept_channels": keep.tolist(), "rms_ratios": ratios,
        "block_linear_params": block, "embedding_params": model.model.embed_tokens.weight.numel(),
        "calibration_tokens": calib.numel()}
(out / "hidden.json").write_text(json.dumps(info, indent=1))
print(json.dumps({k: v for k, v in info.items() if k not in ("kept_channels", "rms_ratios")}),
      "rms ratio range", min(ratios.values()), max(ratios.values()))
