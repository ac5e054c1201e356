"""The peer tool's SparseGPT 2:4, run inside .venv-peer by bench/sparse.py (not by the product).

Input: the model directory and the exact calibration token windows bench/sparse.py uses for
our own SparseGPT (a torch file [n, seq]), so both tools see the same data. Output: the
pruned checkpoint (plain dense tensors, no compression) and a JSON (peer.json) with the wall
time of llm-compressor's `oneshot` alone, the command line and the commit. bench/benchlib.py
imports only the standard library, so it loads here, where the product is not installed.

    .venv-peer/bin/python bench/peer_llmcompressor.py MODEL_DIR WINDOWS.pt OUT_DIR --threads 1
"""

import argparse
import json

import torch

import benchlib  # bench/, this script's directory
import peer_common

# Bumped when the peer's recipe changes; bench/sparse.py reruns cached peer results of another.
PEER_RECIPE = "2: blocks only (lm_head ignored)"


def _zero_fraction(w: torch.Tensor) -> float:
    return (w == 0).float().mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("windows")
    ap.add_argument("out")
    ap.add_argument("--sparsity", default="2:4")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    run = benchlib.run_info()
    from llmcompressor.modifiers.pruning import SparseGPTModifier
    model, tok, windows, ds = peer_common.load(a.model, a.windows, a.threads)
    # "re:.*lm_head", not "lm_head": llm-compressor 0.14 names the head's Linear "lm_head." when
    # it matches ignores, so a plain "lm_head" never matched and the head was pruned to 2:4 too
    # (and with it SmolLM2's tied input embeddings): PPL 103.7 where the blocks alone give ~63.
    recipe = [SparseGPTModifier(sparsity=0.5, mask_structure=a.sparsity, targets=["Linear"], ignore=["re:.*lm_head"])]
    head_zeros_before = _zero_fraction(model.get_output_embeddings().weight)
    wall = peer_common.oneshot(model, ds, windows, recipe)
    head_zeros = _zero_fraction(model.get_output_embeddings().weight)
    if head_zeros > head_zeros_before + 0.01:  # (a GGUF-converted head has ~1% exact zeros already)
        raise SystemExit(f"the peer pruned lm_head ({head_zeros_before:.1%} → {head_zeros:.1%} zeros): "
                         "the comparison would not be like for like")
    # save plain tensors: the bench evaluates the weights, not the compressed storage format
    model.save_pretrained(a.out, save_compressed=False)
    tok.save_pretrained(a.out)
    import llmcompressor
    benchlib.write_result(f"{a.out}/peer.json",
                          {"tool": f"llm-compressor {llmcompressor.__version__}", "oneshot_wall_s": round(wall, 1),
                           "windows": list(windows.shape), "threads": a.threads, "sparsity": a.sparsity,
                           "recipe": PEER_RECIPE, "lm_head_zero_fraction": head_zeros, **run})
    print(json.dumps({"oneshot_wall_s": wall}))


if __name__ == "__main__":
    main()
