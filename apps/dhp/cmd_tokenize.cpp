// `dhp tokenize`: token ids of a Hugging Face tokenizer.json, or text from ids.
#include <torch/torch.h>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dhp/data/image.h"
#include "dhp/data/loader.h"
#include "dhp/data/tokenizer.h"
#include "dhp/io/json.h"
#include "dhp/train/auto_plan.h"
#include "cli.h"

namespace dhp::cli {

int cmd_tokenize(int argc, char** argv, int first) {
  const char* usage =
      "usage: dhp tokenize --tokenizer FILE (--text STR | --file F) [--decode]\n\n"
      "Tokenizes with a Hugging Face tokenizer.json (byte-level BPE of the Qwen2 family, e.g.\n"
      "third_party/qwen-tokenizer/tokenizer.json from scripts/fetch_tokenizer.sh) and prints the ids\n"
      "as a JSON array: of STR, or one array per line of F (without the line's newline).\n"
      "Special tokens written in the text (<|im_start|>, <|image_pad|>, ...) become their ids.\n\n"
      "  --decode   the reverse: STR, or each line of F, is a JSON array of ids; prints the text\n";
  std::string tokenizer, text, file;
  bool has_text = false, decode = false;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const auto& f = flags.flag();
    if (f == "-h" || f == "--help") {
      std::printf("%s", usage);
      return 0;
    }
    if (f == "--tokenizer") tokenizer = flags.value();
    else if (f == "--text") text = flags.value(), has_text = true;
    else if (f == "--file") file = flags.value();
    else if (f == "--decode") decode = true;
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp tokenize --help)");
  }
  DHP_CHECK(!tokenizer.empty(), "dhp tokenize needs --tokenizer FILE\n\n", usage);
  DHP_CHECK(has_text != !file.empty(), "dhp tokenize needs exactly one of --text and --file\n\n", usage);
  const auto tok = dhp::data::Tokenizer::from_file(tokenizer);
  std::vector<std::string> inputs;
  if (has_text) {
    inputs.push_back(text);
  } else {
    std::ifstream in(file, std::ios::binary);
    DHP_CHECK(in.good(), "cannot read --file ", file);
    for (std::string line; std::getline(in, line);) inputs.push_back(line);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string where = has_text ? std::string("--text") : file + " line " + std::to_string(i + 1);
    if (decode) {
      std::vector<int64_t> ids;
      const auto j = dhp::io::Json::parse(inputs[i], where);  // errors name `where`
      for (const auto& e : j.elements(where + " (a JSON array of ids)")) ids.push_back(e.integer(where + " id"));
      try {
        std::printf("%s\n", tok.decode(ids).c_str());
      } catch (const dhp::Error& e) {
        DHP_FAIL(where, ": ", e.what());
      }
      continue;
    }
    std::vector<int64_t> ids;
    try {
      ids = tok.encode(inputs[i]);
    } catch (const dhp::Error& e) {
      DHP_FAIL(where, ": ", e.what());
    }
    std::string out = "[";
    for (size_t k = 0; k < ids.size(); ++k) out += (k ? ", " : "") + std::to_string(ids[k]);
    std::printf("%s]\n", out.c_str());
  }
  return 0;
}

}  // namespace dhp::cli
