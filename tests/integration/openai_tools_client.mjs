// Tool calls and the Responses API through real clients: the openai SDK (chat tools with
// tool_choice auto, required and named, streamed and not; a multi-turn exchange with tool
// results; responses.create plain, streamed and with function tools), LangChain JS ChatOpenAI
// (bindTools, and useResponsesApi) and the Vercel AI SDK (@ai-sdk/openai-compatible tools).
//
// Random weights never call a tool by themselves, so calls come from tool_choice required or a
// named function, which constrained decoding makes valid. When the server does not enforce
// output constraints (response_format json_object refused), the checks that need valid calls
// are reported as skipped and the rest still run: parsing and framing, templates, refusals.
// usage: node openai_tools_client.mjs BASE_URL MODEL
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { ChatOpenAI } from '@langchain/openai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { generateText, streamText, tool, jsonSchema } from 'ai';

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 60000 });

// Enums only, so that a forced call of random weights is short enough to end within max_tokens.
const weatherParams = {
  type: 'object',
  properties: { city: { type: 'string', enum: ['Oslo', 'Lima'] },
                unit: { type: 'string', enum: ['c', 'f'] } },
  required: ['city'],
  additionalProperties: false,
};
const tools = [
  { type: 'function', function: { name: 'get_weather', description: 'The weather in a city',
                                  parameters: weatherParams } },
  { type: 'function', function: { name: 'get_time', description: 'The time now',
                                  parameters: { type: 'object', properties: {} } } },
];
const ask = [{ role: 'user', content: 'What is the weather in Oslo?' }];
const short = { model, temperature: 0, max_tokens: 24 };

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

// The chat stream's text, its calls put together as the SDK's users do, and its finish reason.
async function collectChat(stream) {
  let content = '';
  let finish = null;
  const calls = [];
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    content += choice.delta.content ?? '';
    for (const call of choice.delta.tool_calls ?? []) {
      if (call.id !== undefined) {
        // A call's first chunk: its index, id, type and name, before any arguments.
        assert.equal(calls.length, call.index);
        assert.equal(call.type, 'function');
        assert.equal(call.function.arguments, '');
        calls.push({ id: call.id, name: call.function.name, arguments: '' });
      } else {
        assert.ok(calls[call.index], `arguments before the call's id: ${JSON.stringify(call)}`);
        calls[call.index].arguments += call.function.arguments;
      }
    }
    if (choice.finish_reason) finish = choice.finish_reason;
  }
  return { content, calls, finish };
}

// Whether the server enforces output constraints (structured outputs, forced tool calls).
async function constrained() {
  try {
    await client.chat.completions.create({ ...short, max_tokens: 1, messages: ask,
                                           response_format: { type: 'json_object' } });
    return true;
  } catch (e) {
    if (e instanceof OpenAI.APIError && e.status === 400 && e.param === 'response_format') {
      return false;
    }
    throw e;
  }
}

let passed = 0;
const skipped = [];
async function check(name, body) {
  await body();
  passed += 1;
}

// What tool_choice auto gives with random weights: text, never a marker, never a false call.
await check('chat tools auto', async () => {
  const r = await client.chat.completions.create({ ...short, messages: ask, tools });
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason === 'tool_calls', (m.tool_calls ?? []).length > 0);
  assert.ok(!(m.content ?? '').includes('<tool_call>'));
  const s = await collectChat(await client.chat.completions.create(
    { ...short, messages: ask, tools, stream: true }));
  assert.equal(s.content, m.content ?? '');
  assert.equal(s.calls.length, (m.tool_calls ?? []).length);
});

// The streaming framing of a named call (valid JSON only once constraints are enforced): the
// streamed arguments are the whole answer's, with finish_reason tool_calls or length.
await check('chat named call framing', async () => {
  const choice = { type: 'function', function: { name: 'get_weather' } };
  const r = await client.chat.completions.create(
    { ...short, messages: ask, tools, tool_choice: choice });
  const m = r.choices[0].message;
  assert.equal(m.content, null);
  assert.equal(m.tool_calls.length, 1);
  assert.match(m.tool_calls[0].id, /^call_[A-Za-z0-9]{24}$/);
  assert.equal(m.tool_calls[0].function.name, 'get_weather');
  const s = await collectChat(await client.chat.completions.create(
    { ...short, messages: ask, tools, tool_choice: choice, stream: true }));
  assert.equal(s.content, '');
  assert.equal(s.calls.length, 1);
  assert.equal(s.calls[0].arguments, m.tool_calls[0].function.arguments);
  assert.ok(['tool_calls', 'length'].includes(s.finish), s.finish);
});

// Tool results go back into the template: an assistant turn with calls, then tool messages.
await check('chat multi-turn with tool results', async () => {
  const turns = [
    ...ask,
    { role: 'assistant', content: null, tool_calls: [
      { id: 'call_1', type: 'function',
        function: { name: 'get_weather', arguments: '{"city": "Oslo"}' } }] },
    { role: 'tool', tool_call_id: 'call_1', content: '{"temperature": 21}' },
  ];
  const r = await client.chat.completions.create({ ...short, messages: turns, tools });
  assert.ok(r.usage.prompt_tokens > 0);
  await expectError(() => client.chat.completions.create({ ...short, tools, messages: [
    ...ask, { role: 'assistant', content: null, tool_calls: [
      { id: 'c', type: 'function', function: { name: 'get_weather', arguments: '{oops' } }] }] }),
  400, 'messages[1].tool_calls[0].function.arguments');
  await expectError(() => client.chat.completions.create(
    { ...short, tools, messages: [...ask, { role: 'tool', content: 'x' }] }),
  400, 'messages[1].tool_call_id');
});

await check('chat tool refusals', async () => {
  await expectError(() => client.chat.completions.create({ ...short, messages: ask,
    tools: [{ type: 'function', function: { name: 'bad name' } }] }),
  400, 'tools[0].function.name');
  await expectError(() => client.chat.completions.create({ ...short, messages: ask, tools,
    tool_choice: { type: 'function', function: { name: 'unknown' } } }),
  400, 'tool_choice.function.name');
  await expectError(() => client.chat.completions.create({ ...short, messages: ask,
    tool_choice: 'required' }), 400, 'tool_choice');
});

await check('responses.create plain and streamed', async () => {
  const r = await client.responses.create({ model, input: 'Say hello', instructions: 'Be brief',
                                            max_output_tokens: 8, temperature: 0 });
  assert.equal(r.object, 'response');
  assert.ok(['completed', 'incomplete'].includes(r.status));
  assert.equal(r.output[0].type, 'message');
  assert.equal(typeof r.output_text, 'string');
  assert.ok(r.usage.output_tokens > 0 && r.usage.output_tokens <= 8, JSON.stringify(r.usage));
  const stream = client.responses.stream({ model, input: 'Say hello', instructions: 'Be brief',
                                           max_output_tokens: 8, temperature: 0 });
  let deltas = '';
  let last = -1;
  for await (const event of stream) {
    assert.equal(event.sequence_number, last + 1);
    last = event.sequence_number;
    if (event.type === 'response.output_text.delta') deltas += event.delta;
  }
  const done = await stream.finalResponse();
  assert.equal(done.output_text, r.output_text);
  assert.equal(deltas, r.output_text);
  // A multi-turn input with a call and its output.
  const again = await client.responses.create({ model, max_output_tokens: 4, input: [
    { role: 'user', content: 'Weather in Oslo?' },
    { type: 'function_call', call_id: 'call_1', name: 'get_weather', arguments: '{"city":"Oslo"}' },
    { type: 'function_call_output', call_id: 'call_1', output: 'sunny' }],
  tools: [{ type: 'function', name: 'get_weather', parameters: weatherParams }] });
  assert.equal(again.object, 'response');
  await expectError(() => client.responses.create({ model, input: 'x',
    previous_response_id: 'resp_1' }), 400, 'previous_response_id');
  await expectError(() => client.responses.create({ model, input: 'x',
    tools: [{ type: 'web_search' }] }), 400, 'tools[0].type');
});

const langchain = (options = {}) => new ChatOpenAI({
  model, apiKey: 'unused', temperature: 0, maxTokens: 16, maxRetries: 0,
  configuration: { baseURL }, ...options });
const weatherTool = { type: 'function', function: tools[0].function };

await check('LangChain bindTools auto and useResponsesApi', async () => {
  const reply = await langchain().bindTools([weatherTool]).invoke('Weather in Oslo?');
  assert.equal(typeof reply.content, 'string');
  assert.ok(Array.isArray(reply.tool_calls));
  const viaResponses = await langchain({ useResponsesApi: true }).invoke('Say hello');
  assert.ok(viaResponses.text.length > 0);
  let streamed = '';
  for await (const chunk of await langchain({ useResponsesApi: true }).stream('Say hello')) {
    streamed += chunk.text;
  }
  assert.equal(streamed, viaResponses.text);
});

const provider = createOpenAICompatible({ name: 'tandem', baseURL, apiKey: 'unused' });
const aiTools = {
  get_weather: tool({ description: 'The weather in a city', inputSchema: jsonSchema(weatherParams) }),
};

await check('AI SDK tools auto', async () => {
  const r = await generateText({ model: provider(model), prompt: 'Weather in Oslo?',
                                 tools: aiTools, maxOutputTokens: 16, temperature: 0 });
  assert.equal(typeof r.text, 'string');
  const s = streamText({ model: provider(model), prompt: 'Weather in Oslo?', tools: aiTools,
                         maxOutputTokens: 16, temperature: 0 });
  let text = '';
  for await (const piece of s.textStream) text += piece;
  assert.equal(text, r.text);
});

if (await constrained()) {
  const valid = (call) => {
    assert.equal(call.function.name, 'get_weather');
    const args = JSON.parse(call.function.arguments);
    assert.equal(typeof args.city, 'string');
  };
  await check('chat tool_choice required and named, streamed and not', async () => {
    for (const tool_choice of ['required', { type: 'function', function: { name: 'get_weather' } }]) {
      const oneTool = [tools[0]];
      const r = await client.chat.completions.create(
        { ...short, max_tokens: 200, messages: ask, tools: oneTool, tool_choice,
          parallel_tool_calls: false });
      assert.equal(r.choices[0].finish_reason, 'tool_calls');
      assert.ok(r.choices[0].message.tool_calls.length >= 1);
      r.choices[0].message.tool_calls.forEach(valid);
      const s = await collectChat(await client.chat.completions.create(
        { ...short, max_tokens: 200, messages: ask, tools: oneTool, tool_choice, stream: true,
          parallel_tool_calls: false }));
      assert.equal(s.finish, 'tool_calls');
      s.calls.forEach((c) => valid({ function: c }));
      // The call goes back with its result, and the conversation goes on.
      const call = r.choices[0].message.tool_calls[0];
      const next = await client.chat.completions.create({ ...short, tools: oneTool, messages: [
        ...ask, r.choices[0].message, { role: 'tool', tool_call_id: call.id, content: 'sunny' }] });
      assert.ok(next.choices[0].message);
    }
  });
  await check('responses.create with a forced function call', async () => {
    const r = await client.responses.create({ model, input: 'Weather in Oslo?', temperature: 0,
      max_output_tokens: 200, tool_choice: 'required',
      tools: [{ type: 'function', name: 'get_weather', parameters: weatherParams }] });
    const call = r.output.find((o) => o.type === 'function_call');
    assert.ok(call, JSON.stringify(r.output));
    valid({ function: call });
  });
  await check('LangChain bindTools required and named', async () => {
    for (const tool_choice of ['required', 'get_weather']) {
      const reply = await langchain({ maxTokens: 200 }).bindTools([weatherTool], { tool_choice })
        .invoke('Weather in Oslo?');
      assert.equal(reply.tool_calls.length >= 1, true, JSON.stringify(reply));
      assert.equal(reply.tool_calls[0].name, 'get_weather');
      assert.equal(typeof reply.tool_calls[0].args.city, 'string');
    }
  });
  await check('AI SDK toolChoice required and named', async () => {
    for (const toolChoice of ['required', { type: 'tool', toolName: 'get_weather' }]) {
      const r = await generateText({ model: provider(model), prompt: 'Weather in Oslo?',
                                     tools: aiTools, toolChoice, maxOutputTokens: 200 });
      assert.ok(r.toolCalls.length >= 1);
      assert.equal(r.toolCalls[0].toolName, 'get_weather');
      assert.equal(typeof r.toolCalls[0].input.city, 'string');
    }
  });
} else {
  skipped.push('forced calls (this server does not enforce output constraints)');
}

console.log(`tool checks: ${passed} passed${skipped.length ? `; skipped: ${skipped.join(', ')}` : ''}`);
