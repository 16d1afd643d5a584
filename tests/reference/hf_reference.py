#!/usr/bin/env python3
"""Reference outputs from Hugging Face transformers for a checkpoint folder.

For each prompt (token ids) it runs the prompt through the model, records the last position's
logits, then decodes greedily for `steps` tokens with the KV-cache and records those tokens and
the logits that chose the last one. Prompts are run one at a time (no padding), so nothing but
the model's own math is in the numbers.

For a model with a sliding window (Mistral; Qwen2 or Qwen3 with use_sliding_window) it also checks that
transformers really applies the window in the attention implementation it chose: the same
checkpoint with the window switched off must give different prefill logits for every prompt
longer than the window (else the fixture would not test the window, and the script fails).

usage: hf_reference.py --model DIR --prompts prompts.json --out out.json
                       [--dtype float32|float16|bfloat16] [--device cpu|cuda]
prompts.json: {"prompts": [[id, ...], ...], "steps": 32}
"""
import argparse
import hashlib
import json
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def window_effect(args, dtype, cfg, prompts, reference):
    """Largest relative change of the prefill logits of the prompts longer than the window when
    the window is switched off; None for a model without one."""
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None
    if cfg.get("model_type") not in ("mistral", "qwen2", "qwen3") or not window:
        return None
    # The same folder with config.json's window switched off (a copy; the weights linked).
    off = dict(cfg)
    off.pop("layer_types", None)
    if cfg["model_type"] == "mistral":
        off["sliding_window"] = None
    else:
        off["use_sliding_window"] = False
    tmp = tempfile.mkdtemp()
    for f in os.listdir(args.model):
        if f != "config.json":
            os.symlink(os.path.abspath(os.path.join(args.model, f)), os.path.join(tmp, f))
    json.dump(off, open(os.path.join(tmp, "config.json"), "w"))
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(args.device).eval()
    worst = float("inf")
    with torch.no_grad():
        for prompt, want in zip(prompts, reference):
            if len(prompt) <= window:
                continue
            got = model(input_ids=torch.tensor([prompt], device=args.device)).logits[0, -1]
            rel = ((got.float() - want).norm() / want.norm()).item()
            worst = min(worst, rel)
    if not worst > 1e-3:
        raise SystemExit("the sliding window of %s has no effect on its logits in transformers "
                         "(smallest change %.3g): the fixture would not test it" % (
                             args.model, worst))
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--logits", default="all", choices=["all", "none"],
                    help="none: keep only tokens and the top-5 of each logits row")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()

    spec = json.load(open(args.prompts))
    steps = int(spec["steps"])
    results = []
    prefills = []
    with torch.no_grad():
        for prompt in spec["prompts"]:
            ids = torch.tensor([prompt], device=args.device)
            out = model(input_ids=ids, use_cache=True)
            past = out.past_key_values
            prefill = out.logits[0, -1].float()
            prefills.append(prefill)
            logits = prefill
            tokens = []
            for _ in range(steps):
                nxt = int(torch.argmax(logits))
                tokens.append(nxt)
                if len(tokens) == steps:
                    break
                out = model(input_ids=torch.tensor([[nxt]], device=args.device),
                            past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
            row = {"prompt": prompt, "greedy": tokens}
            if args.logits == "all":
                row["prefill_logits"] = prefill.cpu().tolist()
                row["final_logits"] = logits.cpu().tolist()
            else:
                row["prefill_top5"] = torch.topk(prefill, 5).indices.cpu().tolist()
            results.append(row)

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    effect = window_effect(args, dtype, cfg, spec["prompts"], prefills)
    files = sorted(f for f in os.listdir(args.model) if f.endswith(".safetensors"))
    json.dump({
        "model": os.path.basename(os.path.normpath(args.model)),
        "sha256": {f: sha256_of(os.path.join(args.model, f)) for f in files},
        "dtype": args.dtype,
        "device": args.device,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "steps": steps,
        "attn_implementation": model.config._attn_implementation,
        # Smallest relative change of a longer-than-window prompt's prefill logits with the
        # window off (absent: no window).
        **({"window_effect": effect} if effect is not None else {}),
        "results": results,
    }, open(args.out, "w"))


if __name__ == "__main__":
    main()
