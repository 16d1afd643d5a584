#!/usr/bin/env python3
"""The CUDA engine against Hugging Face transformers on the GPU, on one checkpoint folder.

Makes N prompts of different lengths (seeded token ids), runs them through `tandem-bench
--dump_logits` (prefill logits, greedy tokens, logits of the last decode step), then through
Hugging Face transformers on the same device in the same dtype, prompt by prompt without padding,
decoding greedily with the KV-cache exactly as tests/reference/hf_reference.py does. Compares on the
device, so that no logits file of a 50k vocabulary needs to leave it:
  - prefill logits: relative error ||ours - hf|| / ||hf|| (HF's logits as float32)
  - final logits (the decode step that chose the last token), when the tokens agree up to there
  - the largest absolute logit error, max |ours - hf| over the vocabulary, of the same logits
  - greedy tokens: identical for every step; at the first step that differs, HF's top-2 gap and
    HF's margin between its token and ours, so a near-tie is told apart from a bug. The rule
    judged: identical greedy tokens wherever HF's own top-2 gap is larger than the measured
    logits error (the largest absolute logit error over every prompt); a divergence at a gap
    within it is a near-tie that two fp16 implementations may break either way.
With --hf_self, HF is also compared with itself: the same checkpoint loaded a second time with
attn_implementation="eager" (HF's other valid fp16 attention path) decodes the same prompts, and
the same measures are printed for HF-eager against HF-sdpa: how often two fp16 paths of the
reference itself agree on these checkpoints.
Prints one line per prompt and a summary; --json writes everything.

usage: compare_gpu.py --model DIR --bench PATH/tandem-bench [--dtype float16|bfloat16]
                      [--prompts 20] [--steps 32] [--lengths 2048,8192] [--max_rel 1e-2]
                      [--hf_self] [--json OUT.json]
--lengths: prompt lengths to cycle through instead of the built-in 1..500 (long prefills: the
tensor-core prefill attention and its chunks of the forward pass).
exit status: 0 when every prompt is within --max_rel and every greedy divergence is at a near-tie
(HF's top-2 gap at most the measured logits error), 1 otherwise (the HF-against-HF figures are
reported, never judged).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

# Lengths from 1 token to several hundred: decode over short and long KV-caches.
LENGTHS = [1, 2, 3, 5, 8, 12, 17, 24, 33, 46, 64, 90, 128, 160, 200, 256, 300, 360, 430, 500]


def make_prompts(count, vocab, max_positions, steps, lengths=LENGTHS):
    prompts = []
    for i in range(count):
        n = min(lengths[i % len(lengths)], max_positions - steps)
        g = torch.Generator().manual_seed(1000 + i)
        prompts.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    return prompts


def rel_err(ours, ref):
    return ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def abs_err(ours, ref):
    return (ours - ref).abs().max().item()


def hf_greedy(model, prompt, steps):
    """HF's greedy decode of one prompt with the KV-cache: (prefill logits, logits of every step,
    tokens), logits as float32."""
    out = model(input_ids=torch.tensor([prompt], device="cuda"), use_cache=True)
    past = out.past_key_values
    prefill = out.logits[0, -1].float()
    logits = prefill
    step_logits = []
    tokens = []
    for _ in range(steps):
        step_logits.append(logits)
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        if len(tokens) == steps:
            break
        out = model(input_ids=torch.tensor([[nxt]], device="cuda"), past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return prefill, step_logits, tokens


def hf_self(model_dir, dtype, prompts, steps, reference):
    """HF with eager attention against HF's default (sdpa) decode `reference` (per prompt:
    prefill logits, step logits, tokens): per-prompt rows of the same measures."""
    eager = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager").to("cuda").eval()
    rows = []
    with torch.no_grad():
        for prompt, (ref_prefill, ref_steps, ref_tokens) in zip(prompts, reference):
            prefill, _, tokens = hf_greedy(eager, prompt, steps)
            row = {"prompt_len": len(prompt), "prefill_rel_err": rel_err(prefill, ref_prefill),
                   "tokens_equal": tokens == ref_tokens}
            first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
            if first is not None:
                top2 = torch.topk(ref_steps[first], 2).values
                row.update({"first_diff_step": first,
                            "sdpa_top2_gap": (top2[0] - top2[1]).item()})
            rows.append(row)
    del eager
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--max_rel", type=float, default=1e-2)
    ap.add_argument("--lengths", default="",
                    help="comma-separated prompt lengths (default: 1 to 500 tokens)")
    ap.add_argument("--hf_self", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    vocab = cfg["vocab_size"]
    max_pos = cfg.get("n_positions", cfg.get("max_position_embeddings", 2048))
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else LENGTHS
    prompts = make_prompts(args.prompts, vocab, max_pos, args.steps, lengths)
    name = os.path.basename(os.path.normpath(args.model))

    with tempfile.TemporaryDirectory() as tmp:
        pin, pout = os.path.join(tmp, "prompts.json"), os.path.join(tmp, "ours.json")
        json.dump({"prompts": prompts, "steps": args.steps}, open(pin, "w"))
        bench_dtype = "f16" if args.dtype == "float16" else "bf16"
        subprocess.run([args.bench, "--model", args.model, "--dtype", bench_dtype,
                        "--dump_logits", pin, pout], check=True)
        ours = json.load(open(pout))["results"]

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to("cuda").eval()

    rows = []
    reference = []
    with torch.no_grad():
        for prompt, r in zip(prompts, ours):
            prefill, step_logits, tokens = hf_greedy(model, prompt, args.steps)
            reference.append((prefill, step_logits, tokens))
            mine = r["tokens"]
            ours_prefill = torch.tensor(r["logits"], device="cuda")
            row = {
                "prompt_len": len(prompt),
                "prefill_rel_err": rel_err(ours_prefill, prefill),
                "prefill_max_abs_err": abs_err(ours_prefill, prefill),
                "tokens_equal": mine == tokens,
                "steps": len(tokens),
            }
            first = next((i for i, (a, b) in enumerate(zip(mine, tokens)) if a != b), None)
            if first is None and len(mine) != len(tokens):
                first = min(len(mine), len(tokens))
            if first is None:
                ours_final = torch.tensor(r["final_logits"], device="cuda")
                row["final_rel_err"] = rel_err(ours_final, step_logits[-1])
                row["final_max_abs_err"] = abs_err(ours_final, step_logits[-1])
            elif first < len(step_logits) and first < len(mine):
                lg = step_logits[first]
                top2 = torch.topk(lg, 2).values
                row.update({
                    "first_diff_step": first,
                    "hf_token": tokens[first],
                    "our_token": mine[first],
                    "hf_top2_gap": (top2[0] - top2[1]).item(),
                    "hf_margin_over_ours": (lg[tokens[first]] - lg[mine[first]]).item(),
                    "hf_logit_scale": lg.abs().max().item(),
                })
            rows.append(row)
            extra = ("final rel err %.2e" % row["final_rel_err"] if "final_rel_err" in row else
                     "tokens differ at step %d: hf %d, ours %d, hf top-2 gap %.4g, hf margin over "
                     "ours %.4g (max |logit| %.3g)" % (
                         row.get("first_diff_step", -1), row.get("hf_token", -1),
                         row.get("our_token", -1), row.get("hf_top2_gap", float("nan")),
                         row.get("hf_margin_over_ours", float("nan")),
                         row.get("hf_logit_scale", float("nan"))))
            print("%s %s prompt %3d: prefill rel err %.2e, tokens equal %s, %s" % (
                name, args.dtype, len(prompt), row["prefill_rel_err"], row["tokens_equal"], extra),
                flush=True)

    worst_prefill = max(r["prefill_rel_err"] for r in rows)
    finals = [r["final_rel_err"] for r in rows if "final_rel_err" in r]
    worst_final = max(finals) if finals else float("nan")
    equal = sum(r["tokens_equal"] for r in rows)
    # The measured logits error: the largest absolute logit error of any compared logits.
    logits_err = max(max(r["prefill_max_abs_err"], r.get("final_max_abs_err", 0.0)) for r in rows)
    diverged = [r for r in rows if not r["tokens_equal"]]
    # A divergence without HF's gap (lengths differ past the last step) counts as a real one.
    real = [r for r in diverged if not r.get("hf_top2_gap", float("inf")) <= logits_err]
    gaps = [r["hf_top2_gap"] for r in diverged if "hf_top2_gap" in r]
    ok = worst_prefill <= args.max_rel and not real and all(f <= args.max_rel for f in finals)
    print("SUMMARY %s %s: %d prompts x %d steps, worst prefill rel err %.2e, worst final rel err "
          "%.2e, measured logits error (max abs) %.4g, greedy tokens identical on %d/%d prompts, "
          "HF top-2 gaps at the first differences %s, %d of them above the logits error -> %s" % (
              name, args.dtype, len(rows), args.steps, worst_prefill, worst_final, logits_err,
              equal, len(rows), "[" + ", ".join("%.4g" % g for g in gaps) + "]", len(real),
              "PASS" if ok else "FAIL"), flush=True)
    result = {"model": name, "dtype": args.dtype, "torch": torch.__version__,
              "transformers": __import__("transformers").__version__,
              "steps": args.steps, "max_rel": args.max_rel, "logits_max_abs_err": logits_err,
              "divergences_above_logits_err": len(real), "pass": ok, "prompts": rows}
    if args.hf_self:
        del model
        torch.cuda.empty_cache()
        self_rows = hf_self(args.model, dtype, prompts, args.steps, reference)
        for row in self_rows:
            print("%s %s prompt %3d: HF eager vs HF sdpa: prefill rel err %.2e, tokens equal %s%s" % (
                name, args.dtype, row["prompt_len"], row["prefill_rel_err"], row["tokens_equal"],
                "" if row["tokens_equal"] else ", first differ at step %d (sdpa top-2 gap %.4g)" % (
                    row["first_diff_step"], row["sdpa_top2_gap"])), flush=True)
        print("HF-SELF %s %s: HF eager vs HF sdpa, %d prompts x %d steps: worst prefill rel err "
              "%.2e, greedy tokens identical on %d/%d prompts" % (
                  name, args.dtype, len(self_rows), args.steps,
                  max(r["prefill_rel_err"] for r in self_rows),
                  sum(r["tokens_equal"] for r in self_rows), len(self_rows)), flush=True)
        result["hf_self"] = self_rows
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
