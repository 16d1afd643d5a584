#!/usr/bin/env python3
"""Held-out perplexity of a model served by tandem, scored like perplexity_hf.py.

Reads the windows' token ids that perplexity_hf.py --tokens_out wrote and sends each window as a
prompt of token ids to tandem's /v1/completions with echo and logprobs (max_tokens 1, the least
the API takes); the echoed prompt's token_logprobs give every token of a window but its first,
given the tokens before it in the window, so the figure compares with HF's directly.

usage: perplexity_tandem.py --url http://127.0.0.1:8000 --tokens tokens.json [--label fp16]
                            [--out result.json] [--parallel 8]
"""
import argparse
import concurrent.futures
import json
import math
import urllib.request


def window_nll(url, ids):
    """Sum of -logprob over tokens 1.. of the window, and how many were scored."""
    body = json.dumps({"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        reply = json.load(r)
    logprobs = reply["choices"][0]["logprobs"]["token_logprobs"]
    prompt = logprobs[: len(ids)]  # the generated token's entry follows the prompt's
    if prompt[0] is not None or any(lp is None for lp in prompt[1:]):
        raise RuntimeError(f"unexpected echoed logprobs: {prompt[:4]}...")
    return -sum(prompt[1:]), len(ids) - 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--tokens", required=True)
    p.add_argument("--label", default="")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--out")
    args = p.parse_args()
    with open(args.tokens) as f:
        tokens = json.load(f)
    windows = tokens["windows"]
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        scored = list(pool.map(lambda w: window_nll(args.url, w), windows))
    total = sum(nll for nll, _ in scored)
    count = sum(n for _, n in scored)
    result = {"run": args.label, "seq": tokens["seq"], "windows": len(windows),
              "tokens_scored": count, "nll": total / count,
              "perplexity": math.exp(total / count)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
