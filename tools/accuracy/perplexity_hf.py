#!/usr/bin/env python3
"""Held-out perplexity of a Hugging Face checkpoint, the reference of the accuracy study.

The held-out text is tokenized as train.py does (a BOS before each chapter, one stream) and cut
into non-overlapping windows of --seq tokens; the perplexity is exp(mean negative log-likelihood)
of every token of a window but its first, given the tokens before it in the window. A run of
tandem is scored the same way (same windows, same tokens), so the figures compare directly.

usage: perplexity_hf.py --model DIR --heldout heldout.txt [--seq 512] [--dtype float16]
                        [--out result.json] [--tokens_out tokens.json]
--tokens_out writes the windows' token ids, for scoring tandem on exactly the same tokens.
"""
import argparse
import json
import math
import os

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from train import tokens_of, windows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--out")
    p.add_argument("--tokens_out")
    args = p.parse_args()
    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    held = windows(tokens_of(tokenizer, args.heldout), args.seq)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation=args.attn).to("cuda")
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(held.size(0)):
            x = held[i : i + 1].to("cuda")
            logits = model(input_ids=x).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits[0, :-1], x[0, 1:], reduction="sum").item()
            count += x.size(1) - 1
    result = {"model": args.model, "dtype": args.dtype, "attention": args.attn, "seq": args.seq,
              "windows": held.size(0), "tokens_scored": count, "nll": total / count,
              "perplexity": math.exp(total / count)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.tokens_out:
        with open(args.tokens_out, "w") as f:
            json.dump({"seq": args.seq, "windows": held.tolist()}, f)


if __name__ == "__main__":
    main()
