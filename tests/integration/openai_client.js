// The openai npm SDK against tandem's HTTP API: models (list and retrieve), completions (every
// prompt form, n, seeds, stop strings and stop_reason, logprobs, echo with logprobs), streaming
// (text equal to the whole answer, usage, no text past a stop string), chat (continue_final_message
// against /tokenize of the same messages), errors (status and param), and an abandoned stream
// freeing its slot.
// usage: node openai_client.js BASE_URL METRICS_HOST_PORT MODEL CHAT(0|1)
'use strict';
const assert = require('node:assert/strict');
const OpenAI = require('openai');

const [baseURL, metricsAddr, model, chat] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 60000 });

async function metric(name, labels) {
  const page = await (await fetch(`http://${metricsAddr}/metrics`)).text();
  let total = 0;
  for (const line of page.split('\n')) {
    if (!line.startsWith(name)) continue;
    if (labels && !line.includes(labels)) continue;
    if (line[name.length] !== ' ' && line[name.length] !== '{') continue;
    total += Number(line.split(' ').pop());
  }
  return total;
}

async function expectError(call, status, param) {
  try {
    await call();
  } catch (e) {
    assert.ok(e instanceof OpenAI.APIError, `not an APIError: ${e}`);
    assert.equal(e.status, status, `status of ${e.message}`);
    assert.equal(e.param ?? null, param, `param of ${e.message}`);
    return;
  }
  assert.fail(`expected HTTP ${status} (${param})`);
}

async function collect(stream) {
  const texts = {};
  const finish = {};
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      const piece = c.text ?? c.delta?.content ?? '';
      texts[c.index] = (texts[c.index] ?? '') + piece;
      if (c.finish_reason) finish[c.index] = c.finish_reason;
    }
  }
  return { texts, finish, usage, chunks };
}

async function main() {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [model]);
  const retrieved = await client.models.retrieve(model);
  assert.equal(retrieved.id, model);
  assert.equal(retrieved.object, 'model');
  await expectError(() => client.models.retrieve('no-such-model'), 404, null);

  const greedy = { model, prompt: 'Once upon a time', max_tokens: 12, temperature: 0,
                   ignore_eos: true };
  const a = await client.completions.create(greedy);
  assert.equal(a.object, 'text_completion');
  assert.equal(a.choices.length, 1);
  assert.equal(a.choices[0].finish_reason, 'length');
  assert.equal(a.usage.completion_tokens, 12);
  assert.ok(a.choices[0].text.length > 0);
  const b = await client.completions.create(greedy);
  assert.equal(b.choices[0].text, a.choices[0].text, 'greedy is deterministic');

  // Every prompt form; n choices per prompt, indexed prompt-major.
  const tok = await (await fetch(baseURL.replace(/\/v1$/, '') + '/tokenize', {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt: 'Once upon a time' }) })).json();
  assert.ok(tok.count > 0 && tok.tokens.length === tok.count);
  const byIds = await client.completions.create({ ...greedy, prompt: tok.tokens });
  assert.equal(byIds.choices[0].text, a.choices[0].text, 'token-id prompt = its text');
  const many = await client.completions.create({
    model, prompt: ['Once upon a time', [tok.tokens[0]]], n: 2, max_tokens: 3,
    ignore_eos: true, temperature: 1, seed: 7 });
  assert.deepEqual(many.choices.map((c) => c.index), [0, 1, 2, 3]);
  assert.equal(many.usage.completion_tokens, 12);
  assert.equal(many.usage.prompt_tokens, tok.count + 1);

  // A seed reproduces; choices of one request differ in their seeds.
  const seeded = { model, prompt: 'The', max_tokens: 16, temperature: 1, seed: 11, n: 2,
                   ignore_eos: true };
  const s1 = await client.completions.create(seeded);
  const s2 = await client.completions.create(seeded);
  assert.deepEqual(s1.choices.map((c) => c.text), s2.choices.map((c) => c.text));
  assert.notEqual(s1.choices[0].text, s1.choices[1].text);

  // A stop string: the text ends right before it, whole or streamed.
  const full = a.choices[0].text;
  const stop = full.slice(Math.floor(full.length / 2), Math.floor(full.length / 2) + 2);
  const cut = full.slice(0, full.indexOf(stop));
  const stopped = await client.completions.create({ ...greedy, stop });
  assert.equal(stopped.choices[0].text, cut);
  assert.equal(stopped.choices[0].finish_reason, 'stop');
  assert.equal(stopped.choices[0].stop_reason, stop);
  assert.equal(a.choices[0].stop_reason, null);
  let streamedStopReason;
  const stoppedStream = await collect(
    await client.completions.create({ ...greedy, stop: [stop], stream: true }));
  assert.equal(stoppedStream.texts[0], cut);
  for await (const chunk of await client.completions.create({ ...greedy, stop: [stop],
                                                              stream: true })) {
    if (chunk.choices[0]?.finish_reason) streamedStopReason = chunk.choices[0].stop_reason;
  }
  assert.equal(streamedStopReason, stop);

  // min_tokens: no stop condition ends a choice before it (the first token already holds the
  // stop string here).
  const first = full.slice(0, 1);
  const early = await client.completions.create({ ...greedy, stop: first });
  assert.equal(early.usage.completion_tokens, 1);
  const late = await client.completions.create({ ...greedy, stop: first, min_tokens: 3 });
  assert.equal(late.usage.completion_tokens, 4);
  assert.equal(late.choices[0].finish_reason, 'stop');

  // Streaming gives the same text, one chunk per token, and the usage last when asked for.
  const st = await collect(await client.completions.create({
    ...greedy, stream: true, stream_options: { include_usage: true } }));
  assert.equal(st.texts[0], full);
  assert.equal(st.finish[0], 'length');
  assert.equal(st.usage.completion_tokens, 12);
  assert.equal(st.chunks, 12 + 1);
  const echo = await client.completions.create({ ...greedy, echo: true });
  assert.equal(echo.choices[0].text, 'Once upon a time' + full);
  // echo with logprobs: the prompt's tokens first (the first has none), then the generated ones.
  const echoLp = await client.completions.create({ ...greedy, echo: true, logprobs: 1 });
  const el = echoLp.choices[0].logprobs;
  assert.equal(el.tokens.length, tok.count + 12);
  assert.equal(el.token_logprobs[0], null);
  assert.equal(el.top_logprobs[0], null);
  for (let i = 1; i < el.tokens.length; i++) assert.ok(el.token_logprobs[i] <= 0, `entry ${i}`);
  assert.equal(el.tokens.slice(tok.count).join(''), full);
  assert.equal(el.text_offset[tok.count], 'Once upon a time'.length);
  // Streamed: the first chunk carries the prompt's text and logprobs, then one token a chunk.
  const streamedLp = { tokens: [], token_logprobs: [] };
  for await (const chunk of await client.completions.create({ ...greedy, echo: true, logprobs: 1,
                                                             stream: true })) {
    const l = chunk.choices[0]?.logprobs;
    if (!l) continue;
    streamedLp.tokens.push(...l.tokens);
    streamedLp.token_logprobs.push(...l.token_logprobs);
  }
  assert.deepEqual(streamedLp.tokens, el.tokens);
  assert.equal(streamedLp.token_logprobs[0], null);
  for (let i = 1; i < el.tokens.length; i++) {
    assert.ok(Math.abs(streamedLp.token_logprobs[i] - el.token_logprobs[i]) < 1e-4, `entry ${i}`);
  }

  // Logprobs: one entry per token, with the alternatives asked for, most likely first.
  const lp = await client.completions.create({ ...greedy, logprobs: 3 });
  const l = lp.choices[0].logprobs;
  assert.equal(l.token_logprobs.length, 12);
  assert.equal(l.tokens.join(''), lp.choices[0].text);
  for (let i = 0; i < 12; i++) {
    const alts = Object.values(l.top_logprobs[i]);
    assert.ok(alts.length >= 1 && alts.length <= 3);
    assert.ok(l.token_logprobs[i] <= 0);
    // Greedy picks the most likely token.
    assert.ok(Math.abs(Math.max(...alts) - l.token_logprobs[i]) < 1e-4);
  }

  // A stop token: stop_reason is its id.
  const firstId = (await client.completions.create({ ...greedy, return_token_ids: true }))
    .choices[0].token_ids[0];
  const byToken = await client.completions.create({ ...greedy, stop_token_ids: [firstId] });
  assert.equal(byToken.choices[0].finish_reason, 'stop');
  assert.equal(byToken.choices[0].stop_reason, firstId);

  // vLLM's token-id options: the generated ids (the same, streamed a chunk at a time), the
  // prompt's, and logprobs that name tokens "token_id:N" (the same ids).
  const ids = await client.completions.create({ ...greedy, logprobs: 2, return_token_ids: true,
                                                return_tokens_as_token_ids: true });
  const gen = ids.choices[0].token_ids;
  assert.equal(gen.length, 12);
  assert.ok(ids.choices[0].prompt_token_ids.length >= 1);
  assert.deepEqual(ids.choices[0].logprobs.tokens, gen.map((t) => `token_id:${t}`));
  for (const alts of ids.choices[0].logprobs.top_logprobs) {
    for (const k of Object.keys(alts)) assert.match(k, /^token_id:\d+$/);
  }
  const streamed = [];
  let promptIds = 0;
  for await (const chunk of await client.completions.create({ ...greedy, stream: true,
                                                             return_token_ids: true })) {
    for (const c of chunk.choices) {
      streamed.push(...(c.token_ids ?? []));
      if (c.prompt_token_ids) promptIds++;
    }
  }
  assert.deepEqual(streamed, gen);
  assert.equal(promptIds, 1);

  // Errors name the field.
  await expectError(() => client.completions.create({ model, prompt: 'x', temperature: 5 }),
                    400, 'temperature');
  await expectError(() => client.completions.create({ model, prompt: 'x', n: 0 }), 400, 'n');
  await expectError(() => client.completions.create({ model, prompt: 'x', stop: [1] }),
                    400, 'stop[0]');
  await expectError(() => client.completions.create({ model, prompt: [999999] }), 400, 'prompt');
  await expectError(() => client.completions.create({ model, prompt: 'x', max_tokens: 100000 }),
                    400, 'max_tokens');
  await expectError(() => client.completions.create({ model: 'other', prompt: 'x' }), 404, null);
  await expectError(() => client.completions.create({ model, prompt: 'x', max_tokens: 200,
                                                      ignore_eos: true, timeout: 0.001 }),
                    504, null);

  if (chat === '1') {
    const messages = [{ role: 'system', content: 'You are terse.' },
                      { role: 'user', content: 'Say hi.' }];
    const c = await client.chat.completions.create({ model, messages, max_tokens: 6,
                                                     temperature: 0, ignore_eos: true,
                                                     logprobs: true, top_logprobs: 2 });
    assert.equal(c.object, 'chat.completion');
    assert.equal(c.choices[0].message.role, 'assistant');
    assert.equal(c.choices[0].logprobs.content.length, 6);
    assert.ok(c.choices[0].logprobs.content[0].top_logprobs.length <= 2);
    const cs = await collect(await client.chat.completions.create({
      model, messages, max_tokens: 6, temperature: 0, ignore_eos: true, stream: true }));
    assert.equal(cs.texts[0], c.choices[0].message.content);
    assert.equal(cs.finish[0], 'length');
    await expectError(() => client.chat.completions.create({
      model, messages: [{ role: 'robot', content: 'x' }] }), 400, 'messages[0].role');

    // continue_final_message: the prompt ends inside the assistant's message, exactly as
    // /tokenize renders the same messages; closing the turn makes it longer.
    const prefill = [{ role: 'user', content: 'Tell a story.' },
                     { role: 'assistant', content: 'Once upon' }];
    const tokenize = async (body) => (await fetch(baseURL.replace(/\/v1$/, '') + '/tokenize', {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify(body) })).json();
    const open = await tokenize({ messages: prefill, continue_final_message: true,
                                  add_generation_prompt: false });
    const closed = await tokenize({ messages: prefill, add_generation_prompt: false });
    assert.ok(open.count > 0 && open.count < closed.count, `${open.count} vs ${closed.count}`);
    const cont = await client.chat.completions.create({
      model, messages: prefill, max_tokens: 2, ignore_eos: true,
      continue_final_message: true, add_generation_prompt: false });
    assert.equal(cont.usage.prompt_tokens, open.count);
    await expectError(() => client.chat.completions.create({
      model, messages: prefill, continue_final_message: true, add_generation_prompt: true }),
                      400, 'continue_final_message');
  } else {
    await expectError(() => client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'x' }] }), 400, 'messages');
  }

  // An abandoned stream is cancelled at once and frees the only slot (--max_slots=1): it would
  // otherwise run 4,000 tokens (a second or more) and end "ok".
  const before = await metric('tandem_requests_total', 'outcome="cancelled"');
  const okBefore = await metric('tandem_requests_total', 'outcome="ok"');
  const long = await client.completions.create({ model, prompt: 'x', max_tokens: 4000,
                                                 ignore_eos: true, stream: true });
  let seen = 0;
  for await (const chunk of long) {
    if (++seen === 2) break;  // leaving the loop aborts the request
  }
  for (;;) {
    if (await metric('tandem_requests_total', 'outcome="cancelled"') > before &&
        await metric('tandem_running_sequences') === 0) break;
    assert.equal(await metric('tandem_requests_total', 'outcome="ok"'), okBefore,
                 'the abandoned stream ran to its end');
    await new Promise((r) => setTimeout(r, 20));
  }
  const after = await client.completions.create({ ...greedy, max_tokens: 2 });
  assert.equal(after.usage.completion_tokens, 2);
  console.log('openai SDK: all checks passed');
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
