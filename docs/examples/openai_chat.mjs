// tandem's OpenAI-compatible HTTP API through the openai npm SDK: a completion, then a streamed
// chat answer. The model's name is asked of the server (/v1/models: --served_model_name, by
// default the name of the model's folder), so the example runs against any tandem unchanged.
// usage: npm install openai && node openai_chat.mjs [BASE_URL]   (default http://127.0.0.1:8000/v1)
// With --api_key on the server, export TANDEM_API_KEY first.
import OpenAI from 'openai';

const baseURL = process.argv[2] ?? 'http://127.0.0.1:8000/v1';
const client = new OpenAI({ baseURL, apiKey: process.env.TANDEM_API_KEY ?? 'unused' });

const [{ id: model }] = (await client.models.list()).data;
console.log(`model: ${model}`);

const completion = await client.completions.create({
  model, prompt: 'Once upon a time', max_tokens: 16, temperature: 0 });
console.log(`completion: ${JSON.stringify(completion.choices[0].text)}`);

try {
  const stream = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Hi!' }], max_tokens: 32, stream: true });
  process.stdout.write('chat: ');
  for await (const chunk of stream) process.stdout.write(chunk.choices[0]?.delta?.content ?? '');
  process.stdout.write('\n');
} catch (e) {
  // A folder whose tokenizer_config.json has no chat template serves completions only (the
  // demo's random model is one).
  if (!(e instanceof OpenAI.BadRequestError) || !e.message.includes('chat template')) throw e;
  console.log(`chat: refused: ${e.message}`);
}
