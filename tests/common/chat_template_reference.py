#!/usr/bin/env python3
"""Renders chat templates with Jinja2 configured as Hugging Face transformers configures it, renders
the same cases with tandem's interpreter (chat_template_compare), and compares byte for byte.

Usage: chat_template_reference.py <templates.json> <conversations.json> <chat_template_compare> <workdir>

templates.json: {id: {"source": ..., "bos_token": ..., "eos_token": ...}}. Every template is rendered
for every conversation, with add_generation_prompt false and true. A case passes when both render
the same text, or both fail (and, when the template called raise_exception, with the same message).
"""
import datetime
import json
import subprocess
import sys

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class RaisedByTemplate(jinja2.exceptions.TemplateError):
    pass


class Generation(Extension):
    """transformers' {% generation %} block: writes its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def raise_exception(message):
    raise RaisedByTemplate(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers replaces Jinja2's HTML-escaping tojson with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


FIXED_NOW = datetime.datetime(2024, 7, 26, 12, 0, 0)


def strftime_now(fmt):
    return FIXED_NOW.strftime(fmt)


def make_environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def reference_results(templates, cases):
    env = make_environment()
    compiled = {}
    for tid, t in templates.items():
        try:
            compiled[tid] = env.from_string(t["source"])
        except jinja2.exceptions.TemplateError as e:
            compiled[tid] = e
    results = []
    for case in cases:
        template = compiled[case["template"]]
        if isinstance(template, Exception):
            results.append({"ok": False, "error": str(template), "raised": False})
            continue
        try:
            results.append({"ok": True, "text": template.render(**case["context"])})
        except RaisedByTemplate as e:
            results.append({"ok": False, "error": str(e), "raised": True})
        except Exception as e:  # noqa: BLE001 - any failure of the reference is an expected error
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}", "raised": False})
    return results


def main():
    templates_path, conversations_path, compare, workdir = sys.argv[1:5]
    with open(templates_path, encoding="utf-8") as f:
        templates = json.load(f)
    with open(conversations_path, encoding="utf-8") as f:
        conversations = json.load(f)
    cases = []
    for tid in sorted(templates):
        for conv in conversations:
            for add_generation_prompt in (False, True):
                context = {
                    "messages": conv["messages"],
                    "tools": conv.get("tools"),
                    "documents": None,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": templates[tid]["bos_token"],
                    "eos_token": templates[tid]["eos_token"],
                }
                for key, value in conv.items():
                    if key not in ("name", "messages", "tools"):
                        context[key] = value
                cases.append({"template": tid, "conversation": conv["name"],
                              "context": context})
    cases_path = f"{workdir}/chat_template_cases.json"
    results_path = f"{workdir}/chat_template_results.json"
    with open(cases_path, "w", encoding="utf-8") as f:
        json.dump({"templates": {tid: t["source"] for tid, t in templates.items()},
                   "cases": cases}, f, ensure_ascii=False)
    subprocess.run([compare, cases_path, results_path], check=True)
    with open(results_path, encoding="utf-8") as f:
        ours = json.load(f)
    expected = reference_results(templates, cases)

    passed = failed = 0
    per_template = {}
    for case, want, got in zip(cases, expected, ours):
        tid = case["template"]
        stats = per_template.setdefault(tid, {"same": 0, "errors": 0, "failed": 0})
        problem = None
        if want["ok"] and got["ok"]:
            if want["text"] != got["text"]:
                problem = f"text differs\n  jinja2: {want['text']!r}\n  tandem: {got['text']!r}"
        elif want["ok"]:
            problem = f"tandem failed: {got['error']}"
        elif got["ok"]:
            problem = f"jinja2 failed ({want['error']}) but tandem rendered {got['text']!r}"
        elif want["raised"] and want["error"] != got["error"]:
            problem = f"raise_exception message differs: {want['error']!r} vs {got['error']!r}"
        if problem:
            failed += 1
            stats["failed"] += 1
            print(f"FAIL {tid} / {case['conversation']} / "
                  f"add_generation_prompt={case['context']['add_generation_prompt']}: {problem}")
        else:
            passed += 1
            stats["same" if want["ok"] else "errors"] += 1
    for tid, stats in sorted(per_template.items()):
        print(f"{tid}: {stats['same']} identical, {stats['errors']} errors in both, "
              f"{stats['failed']} different")
    never_rendered = [tid for tid, s in per_template.items() if s["same"] == 0 and s["failed"] == 0]
    if never_rendered:
        print(f"templates that rendered no case in Jinja2: {never_rendered}")
    print(f"{len(templates)} templates x {len(conversations)} conversations x 2: "
          f"{passed} identical or failing in both")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
