#!/usr/bin/env bash
# Checks a folder with only a SentencePiece tokenizer.model against SentencePiece's own command
# line encoder and decoder: trains a small byte-fallback BPE model on the corpus with spm_train,
# has spm_encode / spm_decode encode and decode every corpus line, and compares our Tokenizer
# (FromDir on that folder) with tokenizer_sentencepiece_compare.
# Exit status 77 (ctest's SKIP_RETURN_CODE) when Debian's sentencepiece tools are not installed;
# a failure instead with CI=true (tests/skip.sh).
# Usage: tokenizer_sentencepiece_test.sh <work dir> <tokenizer_sentencepiece_compare> <tests/common>
set -euo pipefail
work=$1
compare=$2
here=$3
corpora=("$here/data/tokenizer_corpus.txt" "$here/data/tokenizer_corpus_hf.txt")

source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
for tool in spm_train spm_encode spm_decode; do
  command -v $tool >/dev/null || skip "$tool is not installed (Debian package sentencepiece)"
done
rm -rf "$work"
mkdir -p "$work/model"
cat "${corpora[@]}" > "$work/corpus.txt"
spm_train --input="$work/corpus.txt" --model_prefix="$work/model/tokenizer" --vocab_size=800 \
  --model_type=bpe --byte_fallback=true --character_coverage=0.995 --num_threads=1 \
  --minloglevel=2 >"$work/spm_train.log" 2>&1 || { tail -5 "$work/spm_train.log"; exit 1; }
rm -f "$work/model/tokenizer.vocab"
spm_encode --model="$work/model/tokenizer.model" --output_format=id <"$work/corpus.txt" >"$work/ids.txt"
spm_decode --model="$work/model/tokenizer.model" --input_format=id <"$work/ids.txt" >"$work/decoded.txt"
"$compare" "$work/model" "$work/corpus.txt" "$work/ids.txt" "$work/decoded.txt"
