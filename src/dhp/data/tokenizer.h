// Byte-level BPE tokenizer for Hugging Face tokenizer.json files of the Qwen2 family
// (Qwen2, Qwen2.5, Qwen2.5-VL, Qwen3 share the format and the vocabulary):
//   1. added tokens (special or not: <|im_start|>, <|image_pad|>, <think>, ...) are cut out
//      of the raw text first, leftmost and longest first, and map to their ids;
//   2. the rest is NFC-normalised (ICU);
//   3. split by Qwen's pre-tokenizer regex
//        (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//      (hand-compiled: Unicode letters and numbers from ICU's general categories, \s its
//      White_Space property, as the Rust tokenizers' Oniguruma regex has them);
//   4. each piece's UTF-8 bytes go through BPE: start from one token per byte (ByteLevel's
//      byte -> character table is only how tokenizer.json spells them) and apply the
//      lowest-ranked merge first, leftmost among equals, until none applies.
// decode() concatenates the tokens' bytes (added tokens: their text); invalid UTF-8 (a
// split character) becomes U+FFFD as in Hugging Face's ByteLevel decoder.
// Thread-safe after construction (the piece cache is guarded).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dhp::io {
class Json;
}

namespace dhp::data {

class Tokenizer {
 public:
  // Reads a tokenizer.json; throws dhp::Error naming the file and the unsupported or
  // malformed part (another model type, another pre-tokenizer pattern, byte fallback, ...).
  static Tokenizer from_file(const std::string& path);
  Tokenizer(const io::Json& json, const std::string& what);
  Tokenizer(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text` (UTF-8; invalid UTF-8 throws naming the byte offset).
  std::vector<int64_t> encode(std::string_view text) const;
  // Text of `ids`; an id outside the vocabulary throws naming it.
  std::string decode(const std::vector<int64_t>& ids) const;
  // Id of an added token ("<|image_pad|>") or of a vocabulary token given as raw bytes;
  // -1 when there is none.
  int64_t token_id(const std::string& token) const;
  // One past the largest id (vocabulary and added tokens).
  int64_t vocab_size() const { return vocab_size_; }

 private:
  struct Impl;
  void bpe(std::string_view piece, std::vector<int64_t>& out) const;
  std::unique_ptr<Impl> impl_;
  int64_t vocab_size_ = 0;
};

// NFC normalisation of UTF-8 text (ICU).
std::string nfc(std::string_view utf8);
// Qwen's pre-tokenizer split (step 3 above) of UTF-8 text: the pieces, in order, covering it.
std::vector<std::string_view> qwen_split(std::string_view utf8);

}  // namespace dhp::data
