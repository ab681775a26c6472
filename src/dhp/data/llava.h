// LLaVA-format annotations and Qwen's chat template.
//
// Annotation files are a JSON array or JSONL (one object per line) of
//   {"image": "rel/path.jpg" | ["a.jpg", "b.png"] (optional),
//    "video": "clip.mp4" | ["a.mp4", "b.mkv"] (optional), "conversations":
//    [{"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "..."}, ...]}
// ("from" also "user"/"assistant"/"system"), with optional per-record video settings
// "video_start", "video_end" (seconds), "fps" or "nframes", "min_pixels", "max_pixels",
// "total_pixels" (qwen-vl-utils' names; they apply to the record's videos). Every record is
// checked when read; a bad one (malformed JSON, wrong field types, roles out of order, an
// <image> or <video> count that differs from the images or videos, a path that leaves the
// data root, both fps and nframes) is reported as a BadRecord naming file and line (or array
// index) and the reason, and left out.
//
// encode_chat() renders Qwen2-VL's chat template
//   <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n
//   <|im_start|>user\n{text, each <image> -> <|vision_start|><|image_pad|>*n<|vision_end|>,
//                       each <video> -> <|vision_start|><|video_pad|>*n<|vision_end|>}<|im_end|>\n
//   <|im_start|>assistant\n{answer}<|im_end|>\n   ... per turn
// and tokenizes it piece by piece (each piece ends at a special token or after the role
// line, so the ids equal the whole text's unless an answer starts with whitespace). Labels
// are -100 except the assistant answers and their <|im_end|>.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/data/tokenizer.h"

namespace dhp::data {

struct Turn {
  std::string role;  // system, user, assistant
  std::string text;
};

// A record's own video settings; unset values (< 0, nframes 0) leave the dataset's.
struct VideoSettings {
  double start = -1, end = -1, fps = -1, min_pixels = -1, max_pixels = -1, total_pixels = -1;
  int64_t nframes = 0;
};

struct LlavaRecord {
  std::vector<std::string> images;  // paths as written (relative to the data root)
  std::vector<std::string> videos;
  std::string order;                // 'i' or 'v' per <image> / <video> tag, in the order of the text
  VideoSettings video;
  std::vector<Turn> turns;
  std::string where;                // "file:line" or "file[index]"
};

struct BadRecord {
  std::string where, reason;
};

// Reads and checks every record of `path` (JSON array when the first non-space byte is
// '[', else JSONL); image paths must stay inside `root`. Throws only when the file cannot
// be read.
std::vector<LlavaRecord> read_llava(const std::string& path, const std::string& root, std::vector<BadRecord>& bad);

// `rel` joined to `root`, refused (dhp::Error) when the result leaves `root` ("../",
// absolute paths elsewhere, symlinks are not followed here: the path is checked lexically).
std::string resolve_image(const std::string& root, const std::string& rel);

struct ChatOptions {
  std::string system = "You are a helpful assistant.";
  int64_t max_length = 8192;  // tokens; longer samples are cut after their last image or video, or refused
};

struct Encoded {
  std::vector<int64_t> ids;
  std::vector<int64_t> labels;  // the id where it is answer text (or its <|im_end|>), else -100
  bool truncated = false;
};

// image_tokens[i]: merged vision tokens of the record's image i (grid_t*grid_h*grid_w / 4);
// video_tokens[i] those of its video i. Throws dhp::Error with the reason (too long to keep
// its images and videos, no answer left, ...).
Encoded encode_chat(const Tokenizer& tok, const LlavaRecord& r, const std::vector<int64_t>& image_tokens,
                    const ChatOptions& o, const std::vector<int64_t>& video_tokens = {});

}  // namespace dhp::data
