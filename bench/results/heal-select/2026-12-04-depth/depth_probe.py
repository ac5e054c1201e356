"""Probe (issue 25): does removing whole blocks (depth) keep more zero-shot ability than
narrowing every block (width, the default) at the same parameter budget, retain 0.7 of
SmolLM2-135M's blocks = 21 of 30 blocks?

Scored only where the reported figures cannot see (as bench/heal_select.py): held-out KL to the
dense model (its windows) and the zero-shot mean at seed 4321. Blocks are chosen on 8 × 512 (bi) and 2 × 256 (greedy)
tokens of the calibration half (never the held-out windows):
- bi: the 9 blocks whose output is most like their input (ShortGPT's block influence, 1 - cos);
- greedy: remove, 9 times, the block whose removal raises the KL to the dense model least.
Each student is written as a package (a stock LlamaForCausalLM with 21 layers) for heal_select.

    PYTHONPATH=. .venv/bin/python bench/results/heal-select/2026-12-04-depth/depth_probe.py
"""
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from heal_select import SAMPLES, SELECTION_SEED  # noqa: E402

from optimizer import data, load, zeroshot  # noqa: E402
from optimizer.heal import kd_eval  # noqa: E402

HERE = Path(__file__).parent
DROP = 9
torch.set_num_threads(2)
torch.manual_seed(0)
teacher, tok = load.load_model(load.resolve(None))
teacher.eval()
wiki = data.builtin_text("calib").text
held = {"wiki_heldout": data.token_windows(tok, wiki, 1024)[-2:]}
for name in SAMPLES:
    text = data.builtin_sample(name).read_text()
    held[name] = data.token_windows(tok, text[text.rfind("\n", 0, int(len(text) * 0.9)) + 1:], 1024)[:2]
calib = data.token_windows(tok, wiki[: wiki.rfind("\n", 0, int(len(wiki) * 0.97))], 512)
calib = calib[torch.randperm(len(calib), generator=torch.Generator().manual_seed(1))][:8]
greedy_windows = calib[:2, :256]  # the greedy search runs ~250 passes: 512 tokens each


def with_layers(keep: list[int]):
    m = copy.deepcopy(teacher)
    m.model.layers = torch.nn.ModuleList(m.model.layers[i] for i in keep)
    for j, layer in enumerate(m.model.layers):
        layer.self_attn.layer_idx = j
    m.config.num_hidden_layers = len(keep)
    if getattr(m.config, "layer_types", None):
        m.config.layer_types = [m.config.layer_types[i] for i in keep]
    return m


@torch.no_grad()
def block_influence() -> list[float]:
    hs = teacher(calib, output_hidden_states=True, use_cache=False).hidden_states
    return [float(1 - torch.nn.functional.cosine_similarity(hs[i], hs[i + 1], dim=-1).mean())
            for i in range(len(hs) - 1)]


@torch.no_grad()
def calib_kl(keep: list[int], teacher_logp) -> float:
    """The KL to the dense model with only `keep`'s blocks, the blocks shared (no copy)."""
    layers = teacher.model.layers
    teacher.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
    try:
        total = 0.0
        for w, t in zip(greedy_windows, teacher_logp):
            logp = torch.log_softmax(teacher(w[None], use_cache=False).logits[0].float(), -1)
            total += float((t.exp() * (t - logp)).sum(-1).mean())
    finally:
        teacher.model.layers = layers
    return total / len(greedy_windows)


def greedy() -> tuple[list[int], list[dict]]:
    keep = list(range(teacher.config.num_hidden_layers))
    trace = []
    with torch.no_grad():
        teacher_logp = [torch.log_softmax(teacher(w[None], use_cache=False).logits[0].float(), -1) for w in greedy_windows]
    for _ in range(DROP):
        scores = {i: calib_kl([k for k in keep if k != i], teacher_logp) for i in keep[1:-1]}  # first, last stay
        best = min(scores, key=scores.get)
        keep.remove(best)
        trace.append({"removed": best, "kl": round(scores[best], 4)})
        print(trace[-1], flush=True)
    return keep, trace


result = {"held_out": {}, "zeroshot": {}}
started = time.time()
bi = block_influence()
result["block_influence"] = [round(x, 4) for x in bi]
n = len(bi)
keeps = {"bi": sorted(sorted(range(n), key=lambda i: -bi[i])[: n - DROP])}
result["keep"] = keeps


def score(name, keep):
    student = with_layers(keep)
    result["held_out"][name] = {k: round(kd_eval(student, teacher, v), 4) for k, v in held.items()}
    result["held_out"][name]["mean"] = round(sum(result["held_out"][name].values()) / len(held), 4)
    result["zeroshot"][name] = zeroshot.evaluate(student, tok, ["arc_easy", "piqa", "hellaswag"], 300,
                                                 SELECTION_SEED)["mean"]
    pkg = Path("out/depth-probe") / name
    student.save_pretrained(pkg)
    tok.save_pretrained(pkg)
    print(name, result["held_out"][name], result["zeroshot"][name], flush=True)
    (HERE / "depth.json").write_text(json.dumps(result, indent=1) + "\n")


score("bi", keeps["bi"])
started = time.time()
keeps["greedy"], result["greedy_trace"] = greedy()
result["greedy_s"] = round(time.time() - started)
score("greedy", keeps["greedy"])
