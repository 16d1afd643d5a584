// A client made from the .proto files alone (@grpc/grpc-js + @grpc/proto-loader): calls
// Generate, GenerateStream and the health service of a running coordinator and checks the
// answers. usage: node node_client.js HOST:PORT PROTO_DIR HEALTH_PROTO
'use strict';
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const path = require('path');

const [addr, protoDir, healthProto] = process.argv.slice(2);
const options = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };
const tandem = grpc.loadPackageDefinition(
    protoLoader.loadSync(path.join(protoDir, 'tandem.proto'), options)).tandem.v1;
const health = grpc.loadPackageDefinition(
    protoLoader.loadSync(healthProto, options)).grpc.health.v1;

const creds = grpc.credentials.createInsecure();
const inference = new tandem.Inference(addr, creds);
const healthClient = new health.Health(addr, creds);

function fail(msg) {
  console.error('FAIL: ' + msg);
  process.exit(1);
}
function call(client, method, req) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + 30000);
    client[method](req, { deadline }, (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

async function main() {
  const h = await call(healthClient, 'Check', { service: '' });
  if (h.status !== 'SERVING') fail('health status ' + h.status);

  // Long enough that the stream shows several messages: the service coalesces tokens generated
  // faster than the client takes them, and a dozen tokens of this model take under a millisecond.
  const request = { token_ids: [5, 6, 7], max_new_tokens: 200, ignore_eos: true,
                    sampling: { temperature: 0.9, top_k: 20, seed: 3 } };
  const unary = await call(inference, 'Generate', request);
  if (unary.token_ids.length !== 200) fail('Generate returned ' + unary.token_ids.length + ' tokens');
  if (unary.finish_reason !== 'FINISH_REASON_LENGTH') fail('finish ' + unary.finish_reason);
  if (unary.usage.prompt_tokens !== 3 || unary.usage.completion_tokens !== 200) {
    fail('usage ' + JSON.stringify(unary.usage));
  }

  const streamed = await new Promise((resolve, reject) => {
    const tokens = [];
    let finish = null;
    let messages = 0;
    const s = inference.GenerateStream(request);
    s.on('data', (m) => {
      messages++;
      tokens.push(...m.token_ids);
      if (m.finish_reason !== 'FINISH_REASON_UNSPECIFIED') finish = m.finish_reason;
    });
    s.on('error', reject);
    s.on('end', () => resolve({ tokens, finish, messages }));
  });
  if (JSON.stringify(streamed.tokens) !== JSON.stringify(unary.token_ids)) {
    fail('stream ' + streamed.tokens + ' != unary ' + unary.token_ids);
  }
  if (streamed.messages < 2) fail('the stream came in one message');
  if (streamed.finish !== 'FINISH_REASON_LENGTH') fail('stream finish ' + streamed.finish);

  // A bad request comes back as INVALID_ARGUMENT naming the field.
  try {
    await call(inference, 'Generate', { token_ids: [1], max_new_tokens: 0 });
    fail('max_new_tokens 0 was accepted');
  } catch (err) {
    if (err.code !== grpc.status.INVALID_ARGUMENT || !/max_new_tokens/.test(err.details)) {
      fail('bad request answered ' + err.code + ' ' + err.details);
    }
  }
  console.log('node client OK: ' + unary.token_ids.join(' '));
  process.exit(0);
}
main().catch((e) => fail(e.stack || String(e)));
