// Tool calls, structured outputs and the Responses API through real clients: the openai SDK
// (chat tools with tool_choice auto, required and named, streamed and not; a multi-turn exchange
// with tool results; response_format json_schema and json_object; responses.create plain,
// streamed and with function tools), LangChain JS ChatOpenAI (bindTools, withStructuredOutput,
// useResponsesApi) and the Vercel AI SDK (@ai-sdk/openai-compatible tools, generateObject).
// Forced calls' arguments and structured answers are validated by ajv against their schemas.
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
import { generateObject, generateText, streamText, tool, jsonSchema } from 'ai';
import { createRequire } from 'node:module';

const Ajv = createRequire(import.meta.url)('ajv');

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
  // A call is valid when its arguments parse and validate against the tool's parameters.
  const validArguments = new Ajv().compile(weatherParams);
  const valid = (call) => {
    assert.equal(call.function.name, 'get_weather');
    const args = JSON.parse(call.function.arguments);
    assert.ok(validArguments(args),
              `${call.function.arguments}: ${JSON.stringify(validArguments.errors)}`);
  };
  await check('chat tool_choice required and named, streamed and not', async () => {
    for (const tool_choice of ['required', { type: 'function', function: { name: 'get_weather' } }]) {
      const oneTool = [tools[0]];
      const r = await client.chat.completions.create(
        { ...short, max_tokens: 200, messages: ask, tools: oneTool, tool_choice,
          parallel_tool_calls: false });
      assert.equal(r.choices[0].finish_reason, 'tool_calls', JSON.stringify(r.choices[0]));
      assert.equal(r.choices[0].message.tool_calls.length, 1, JSON.stringify(r.choices[0]));
      assert.equal(r.choices[0].message.content, null);
      r.choices[0].message.tool_calls.forEach(valid);
      const s = await collectChat(await client.chat.completions.create(
        { ...short, max_tokens: 200, messages: ask, tools: oneTool, tool_choice, stream: true,
          parallel_tool_calls: false }));
      assert.equal(s.finish, 'tool_calls', JSON.stringify(s));
      assert.equal(s.calls.length, 1, JSON.stringify(s));
      assert.equal(s.content, '');
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
      max_output_tokens: 200, tool_choice: 'required', parallel_tool_calls: false,
      tools: [{ type: 'function', name: 'get_weather', parameters: weatherParams }] });
    const call = r.output.find((o) => o.type === 'function_call');
    assert.ok(call, JSON.stringify(r.output));
    valid({ function: call });
  });
  await check('LangChain bindTools required and named', async () => {
    for (const tool_choice of ['required', 'get_weather']) {
      const reply = await langchain({ maxTokens: 200 })
        .bindTools([weatherTool], { tool_choice, parallel_tool_calls: false })
        .invoke('Weather in Oslo?');
      assert.equal(reply.tool_calls.length, 1, JSON.stringify(reply));
      assert.ok(validArguments(reply.tool_calls[0].args), JSON.stringify(reply.tool_calls[0]));
      assert.equal(reply.tool_calls[0].name, 'get_weather');
      assert.equal(typeof reply.tool_calls[0].args.city, 'string');
    }
  });
  await check('AI SDK toolChoice required and named', async () => {
    for (const toolChoice of ['required', { type: 'tool', toolName: 'get_weather' }]) {
      const r = await generateText({ model: provider(model), prompt: 'Weather in Oslo?',
                                     tools: aiTools, toolChoice, maxOutputTokens: 200,
                                     providerOptions: { tandem: { parallel_tool_calls: false } } });
      assert.equal(r.toolCalls.length, 1, JSON.stringify(r.content));
      assert.equal(r.toolCalls[0].toolName, 'get_weather');
      assert.ok(validArguments(r.toolCalls[0].input), JSON.stringify(r.toolCalls[0]));
    }
  });
  // Structured outputs: each client's way of asking for a schema, its answer validated by ajv.
  const answer = {
    type: 'object',
    properties: { city: { type: 'string', enum: ['Oslo', 'Lima'] },
                  sunny: { type: 'boolean' },
                  note: { type: 'string', maxLength: 4 } },
    required: ['city', 'sunny'],
    additionalProperties: false,
  };
  const validAnswer = new Ajv().compile(answer);
  const assertAnswer = (value, raw) =>
    assert.ok(validAnswer(value),
              `${raw ?? JSON.stringify(value)}: ${JSON.stringify(validAnswer.errors)}`);
  await check('openai SDK response_format json_schema and json_object', async () => {
    for (const stream of [false, true]) {
      const body = { ...short, max_tokens: 200, messages: ask, temperature: 1, seed: 7,
        response_format: { type: 'json_schema', json_schema: { name: 'answer', schema: answer } } };
      let text;
      if (stream) {
        const s = await collectChat(await client.chat.completions.create({ ...body, stream }));
        assert.equal(s.finish, 'stop', JSON.stringify(s));
        text = s.content;
      } else {
        const r = await client.chat.completions.create(body);
        assert.equal(r.choices[0].finish_reason, 'stop', JSON.stringify(r.choices[0]));
        text = r.choices[0].message.content;
      }
      assertAnswer(JSON.parse(text), text);
    }
    const parsed = await client.chat.completions.parse({ ...short, max_tokens: 200, messages: ask,
      response_format: { type: 'json_schema', json_schema: { name: 'answer', schema: answer } } });
    assertAnswer(parsed.choices[0].message.parsed);
    const any = await client.chat.completions.create({ ...short, max_tokens: 200, messages: ask,
      response_format: { type: 'json_object' } });
    // Any object: random weights may write one long string until max_tokens (finish "length").
    const content = any.choices[0].message.content;
    assert.ok(content.startsWith('{'), content);
    if (any.choices[0].finish_reason === 'stop') {
      const object = JSON.parse(content);
      assert.ok(typeof object === 'object' && object !== null && !Array.isArray(object));
    }
  });
  await check('LangChain withStructuredOutput', async () => {
    for (const method of ['jsonSchema', 'functionCalling']) {
      const value = await langchain({ maxTokens: 200 })
        .withStructuredOutput(answer, { name: 'answer', method }).invoke('Weather in Oslo?');
      assertAnswer(value);
    }
  });
  await check('AI SDK generateObject', async () => {
    const strict = createOpenAICompatible({ name: 'tandem', baseURL, apiKey: 'unused',
                                            supportsStructuredOutputs: true });
    const r = await generateObject({ model: strict(model), schema: jsonSchema(answer),
                                     prompt: 'Weather in Oslo?', maxOutputTokens: 200 });
    assertAnswer(r.object);
  });
} else {
  skipped.push('forced calls and structured outputs (this server does not enforce output ' +
               'constraints)');
}

console.log(`tool checks: ${passed} passed${skipped.length ? `; skipped: ${skipped.join(', ')}` : ''}`);
