#!/usr/bin/env python3
"""Reference outputs from Hugging Face transformers for a checkpoint folder.

For each prompt (token ids) it runs the prompt through the model, records the last position's
logits, then decodes greedily for `steps` tokens with the KV-cache and records those tokens and
the logits that chose the last one. Prompts are run one at a time (no padding), so nothing but
the model's own math is in the numbers.

usage: hf_reference.py --model DIR --prompts prompts.json --out out.json
                       [--dtype float32|float16|bfloat16] [--device cpu|cuda]
prompts.json: {"prompts": [[id, ...], ...], "steps": 32}
"""
import argparse
import hashlib
import json
import os

import torch
from transformers import AutoModelForCausalLM


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    with torch.no_grad():
        for prompt in spec["prompts"]:
            ids = torch.tensor([prompt], device=args.device)
            out = model(input_ids=ids, use_cache=True)
            past = out.past_key_values
            prefill = out.logits[0, -1].float()
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

    files = sorted(f for f in os.listdir(args.model) if f.endswith(".safetensors"))
    json.dump({
        "model": os.path.basename(os.path.normpath(args.model)),
        "sha256": {f: sha256_of(os.path.join(args.model, f)) for f in files},
        "dtype": args.dtype,
        "device": args.device,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "steps": steps,
        "results": results,
    }, open(args.out, "w"))


if __name__ == "__main__":
    main()
