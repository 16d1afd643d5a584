#!/usr/bin/env python3
"""Trains the small Llama-shaped model of the accuracy study with Hugging Face transformers.

From the text of prepare_text.sh: tokenizes train.txt and heldout.txt with the Llama-2 tokenizer
(tokenizer.json, Hugging Face's `tokenizers`), trains a LlamaForCausalLM from scratch on
sequences of --seq tokens with AdamW (bf16 autocast, cosine schedule), evaluates the held-out
loss every --eval_every steps and keeps the best weights, then saves them in fp16 as a
Hugging Face folder (config.json, model.safetensors, the tokenizer files) that tandem loads.
Everything random comes from --seed (the data order too); GPU kernels may still make the
last digits differ between runs.

usage: train.py --data DIR --out MODEL_DIR [--steps 400] [--seed 0]
Writes MODEL_DIR and MODEL_DIR/train.json (the losses, the time, the shape).
"""
import argparse
import json
import math
import os
import shutil
import time

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM


def tokens_of(tokenizer, path):
    """The file's paragraphs (one chapter each) encoded without special tokens, each preceded
    by BOS, as one stream."""
    bos = tokenizer.token_to_id("<s>")
    ids = []
    with open(path, encoding="utf-8") as f:
        for paragraph in f:
            paragraph = paragraph.strip()
            if paragraph:
                ids.append(bos)
                ids.extend(tokenizer.encode(paragraph, add_special_tokens=False).ids)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream, seq):
    """Non-overlapping windows of seq tokens (the remainder dropped)."""
    n = stream.numel() // seq
    return stream[: n * seq].view(n, seq)


@torch.no_grad()
def heldout_loss(model, held, batch, device):
    model.eval()
    total, count = 0.0, 0
    for i in range(0, held.size(0), batch):
        x = held[i : i + batch].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda"
    tok_dir = os.path.join(args.data, "tokenizer")
    tokenizer = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    train = windows(tokens_of(tokenizer, os.path.join(args.data, "train.txt")), args.seq)
    held = windows(tokens_of(tokenizer, os.path.join(args.data, "heldout.txt")), args.seq)
    print(f"train {train.numel()} tokens ({train.size(0)} windows), "
          f"held-out {held.numel()} tokens ({held.size(0)} windows)", flush=True)

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=768, intermediate_size=2048,
        num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(train.size(0), generator=gen)
    cursor = 0
    history = []
    best = (float("inf"), None, -1)
    t0 = time.time()
    for step in range(args.steps):
        if cursor + args.batch > order.numel():
            order = torch.randperm(train.size(0), generator=gen)
            cursor = 0
        x = train[order[cursor : cursor + args.batch]].to(device)
        cursor += args.batch
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            held_loss = heldout_loss(model, held, args.batch, device)
            history.append({"step": step + 1, "train_loss": loss.item(), "heldout_loss": held_loss,
                            "seconds": time.time() - t0})
            print(f"step {step + 1}: train loss {loss.item():.3f}, held-out loss {held_loss:.3f} "
                  f"(perplexity {math.exp(held_loss):.2f}), {time.time() - t0:.0f} s", flush=True)
            if held_loss < best[0]:
                best = (held_loss, {k: v.detach().clone() for k, v in model.state_dict().items()},
                        step + 1)
    model.load_state_dict(best[1])
    model.half().save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, name), args.out)
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump({"parameters": params, "best_step": best[2], "best_heldout_loss": best[0],
                   "train_tokens": train.numel(), "heldout_tokens": held.numel(),
                   "seconds": time.time() - t0, "args": vars(args), "history": history}, f,
                  indent=1)
    print(f"saved the weights of step {best[2]} (held-out loss {best[0]:.3f}) to {args.out}")


if __name__ == "__main__":
    main()
