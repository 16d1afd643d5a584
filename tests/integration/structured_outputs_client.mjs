// Constrained outputs under random JSON Schemas, checked by a real validator (ajv): seeded random
// schemas (nested objects and arrays, enums, numbers, integers, strings with escapes and
// patterns, required and optional properties, additionalProperties false), each sampled many
// times at temperature 1 from random weights, so that only the grammar keeps the output valid.
// Every schema is small enough that its longest output fits in max_tokens: each choice must end
// with finish_reason "stop", parse as JSON and validate.
// usage: node structured_outputs_client.mjs BASE_URL SCHEMAS REQUESTS_PER_SCHEMA N SEED
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
const Ajv = require('ajv');
const [baseURL, schemaCount, requestsPerSchema, n, seed] = process.argv.slice(2);
const maxTokens = 400;
const maxOutputBytes = 360;  // the longest output a schema may allow (below max_tokens)

// mulberry32: a small seeded generator, so that a failure can be replayed.
function random(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = random(Number(seed));
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));
const pick = (list) => list[int(0, list.length - 1)];

// Keys and enum values that need escaping in JSON.
const keys = ['id', 'name', 'tags', 'value', 'a b', 'qu"ote', 'back\\slash', 'ünï', 'x_1', 'n'];
const words = ['plain', 'say "hi"', 'back\\slash', 'tab\there', 'line\nbreak', 'ünïcødé', '€',
               '/slash', ''];
const patterns = ['^[a-z]{1,5}$', '^[0-9]{3}-[0-9]{2}$', '^(yes|no|maybe)$', '^[A-F0-9]{2,4}$'];

// A schema and the most bytes of compact JSON it allows: a string's code point takes at most six
// (\uXXXX), a number at most 16 digits in each of its three parts (common/structured/grammar.h).
function leaf() {
  switch (int(0, 7)) {
    case 0: {
      const maxLength = int(1, 6);
      return [{ type: 'string', minLength: int(0, 1), maxLength }, 2 + 6 * maxLength];
    }
    case 1: {
      const values = [...new Set(Array.from({ length: int(1, 4) }, () => pick(words)))];
      return [{ type: 'string', enum: values },
              Math.max(...values.map((v) => JSON.stringify(v).length))];
    }
    case 2: return [{ type: 'string', pattern: pick(patterns) }, 12];
    case 3: return [{ type: 'number' }, 60];
    case 4: return [{ type: 'integer' }, 20];
    case 5: return [{ type: 'boolean' }, 5];
    case 6: return [{ enum: [1, 'two', null, true] }, 5];
    default: return [{ anyOf: [{ type: 'integer' }, { type: 'string', maxLength: 3 }] }, 20];
  }
}
function schema(depth) {
  const kind = depth >= 2 ? 'leaf' : pick(['object', 'object', 'array', 'leaf']);
  if (kind === 'leaf') return leaf();
  if (kind === 'array') {
    const [items, size] = schema(depth + 1);
    const maxItems = int(1, 3);
    return [{ type: 'array', items, minItems: int(0, 1), maxItems }, 2 + maxItems * (size + 1)];
  }
  return object(depth);
}
function object(depth) {
  const names = [...new Set(Array.from({ length: int(1, 4) }, () => pick(keys)))];
  const properties = {};
  const required = [];
  let size = 2;
  for (const name of names) {
    const [s, bytes] = schema(depth + 1);
    properties[name] = s;
    if (rand() < 0.6) required.push(name);
    size += JSON.stringify(name).length + 2 + bytes;
  }
  return [{ type: 'object', properties, required, additionalProperties: false }, size];
}
function rootSchema() {
  for (;;) {
    const [s, bytes] = object(0);
    if (bytes <= maxOutputBytes) return s;
  }
}

async function complete(body) {
  const response = await fetch(`${baseURL}/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
  });
  const text = await response.text();
  if (response.status !== 200) throw new Error(`HTTP ${response.status}: ${text}`);
  return JSON.parse(text);
}

const ajv = new Ajv({ allErrors: true });
const schemas = Array.from({ length: Number(schemaCount) }, rootSchema);
const jobs = [];
schemas.forEach((s, i) => {
  // Choice j of a request samples with seed + j: the requests' seeds are n apart.
  for (let r = 0; r < Number(requestsPerSchema); ++r) {
    jobs.push({ schema: i, seed: i * 1000 + r * Number(n) });
  }
});

const failures = [];
const outputs = new Set();
let generations = 0;
const started = Date.now();
async function run(job) {
  const s = schemas[job.schema];
  const reply = await complete({
    prompt: 'A JSON value:', max_tokens: maxTokens, temperature: 1, seed: job.seed, n: Number(n),
    response_format: { type: 'json_schema', json_schema: { name: `s${job.schema}`, schema: s } },
  });
  const validate = ajv.compile(s);
  for (const choice of reply.choices) {
    generations += 1;
    outputs.add(choice.text);
    let why = null;
    let value;
    if (choice.finish_reason !== 'stop') why = `finish_reason ${choice.finish_reason}`;
    try {
      value = JSON.parse(choice.text);
    } catch (e) {
      why ??= `not JSON (${e.message})`;
    }
    if (why === null && !validate(value)) why = ajv.errorsText(validate.errors);
    if (why !== null) failures.push({ schema: job.schema, seed: job.seed, why, text: choice.text });
  }
}
// Eight requests in flight: n sequences each, batched together by the coordinator.
const queue = [...jobs];
await Promise.all(Array.from({ length: 8 }, async () => {
  while (queue.length > 0) await run(queue.shift());
}));
const seconds = (Date.now() - started) / 1000;

console.log(`structured outputs: ${generations} generations under ${schemas.length} schemas, ` +
            `${outputs.size} distinct, ${failures.length} invalid, in ${seconds.toFixed(1)} s`);
for (const f of failures.slice(0, 5)) {
  console.log(`schema ${f.schema} (seed ${f.seed}): ${f.why}\n  schema: ` +
              `${JSON.stringify(schemas[f.schema])}\n  output: ${JSON.stringify(f.text)}`);
}
if (failures.length > 0) process.exit(1);
// Temperature 1 over random weights: the outputs differ (the grammar, not a fixed answer, is
// what keeps them valid).
if (outputs.size < generations / 2) {
  console.log(`only ${outputs.size} distinct outputs of ${generations}: sampling is not random`);
  process.exit(1);
}
