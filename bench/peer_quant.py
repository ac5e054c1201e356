"""The peer tool's W8A8 of the dense model, run inside .venv-peer by bench/quant.py (not by the product).

Input: the model directory and the calibration token windows bench/quant.py uses for our own
quantization (a torch file [n, seq]), so both tools see the same data. Output: llm-compressor's
compressed checkpoint (compressed-tensors, int8 weights) and peer.json with the wall time of
`oneshot` alone, the recipe, the command line and the commit.

    .venv-peer/bin/python bench/peer_quant.py MODEL_DIR WINDOWS.pt OUT_DIR --recipe plain
    .venv-peer/bin/python bench/peer_quant.py MODEL_DIR WINDOWS.pt OUT_DIR --recipe smoothquant-gptq

Recipes: `plain` is QuantizationModifier(scheme="W8A8") — round to nearest, dynamic per-token
activations, what a user gets in seconds; `smoothquant-gptq` is the peer's calibrated recipe,
SmoothQuantModifier(smoothing_strength=0.8) then GPTQModifier(scheme="W8A8"). The head is
ignored in both (it is tied to the embedding), as ours is.
"""

import argparse
import json

import torch

import benchlib  # bench/, this script's directory
import peer_common

IGNORE = ["re:.*lm_head"]  # llm-compressor names the head's Linear "lm_head." when matching ignores


def recipe(name: str):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    if name == "plain":
        return QuantizationModifier(targets="Linear", scheme="W8A8", ignore=IGNORE)
    try:
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    except ImportError:
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    return [SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=IGNORE)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("windows")
    ap.add_argument("out")
    ap.add_argument("--recipe", choices=["plain", "smoothquant-gptq"], default="plain")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    run = benchlib.run_info()
    model, tok, windows, ds = peer_common.load(a.model, a.windows, a.threads)
    wall = peer_common.oneshot(model, ds, windows, recipe(a.recipe))
    model = model.to(torch.bfloat16)
    model.save_pretrained(a.out, save_compressed=True)
    tok.save_pretrained(a.out)
    benchlib.write_result(f"{a.out}/peer.json", {"recipe": a.recipe, "oneshot_wall_s": round(wall, 1),
                                                 "calibration": {"windows": len(windows), "seq_len": windows.shape[1]},
                                                 **run})
    print(json.dumps({"recipe": a.recipe, "oneshot_wall_s": round(wall, 1)}))


if __name__ == "__main__":
    main()
