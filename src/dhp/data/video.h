// Videos the way Qwen2.5-VL's tools see them: decoded with FFmpeg's libraries (any container
// and codec FFmpeg reads), frames sampled as qwen-vl-utils' smart_nframes does, resized as its
// fetch_video does (torchvision's antialiased bicubic on the 8-bit frames) and cut into
// patches by Hugging Face's processor (rescale, normalise, temporal_patch_size frames per
// patch, merge-window order).
//
// A decode never runs unbounded: the stream's size, frame count and duration are checked
// before any frame is decoded, only the sampled frames are kept (each resized as soon as it
// is decoded), seeking skips to the keyframe before a wanted frame when that saves decoding,
// and a deadline stops a read that takes too long. Every fault throws dhp::Error naming the
// file and the reason.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/data/image.h"

namespace dhp::data {

// qwen-vl-utils' constants (vision_process.py), overridable per dataset (data.video_*) and
// per record (fps, nframes, min_pixels, max_pixels, total_pixels, video_start, video_end).
struct VideoOptions {
  double fps = 2.0;                    // FPS: frames sampled per second of video
  int64_t nframes = 0;                 // > 0: this many frames (rounded to even) instead of fps
  int64_t min_frames = 4;              // FPS_MIN_FRAMES
  int64_t max_frames = 768;            // FPS_MAX_FRAMES
  double min_pixels = 128 * 28 * 28;   // VIDEO_MIN_PIXELS, per frame
  double max_pixels = 768 * 28 * 28;   // VIDEO_MAX_PIXELS, per frame
  double requested_max_pixels = -1;    // a record's "max_pixels" (> 0): caps the budget below
  double total_pixels = 90316800;      // VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9), all frames
  double start = -1, end = -1;         // video_start / video_end in seconds; < 0: not set
  // Refused before decoding (absurd inputs): sides, frames and seconds of the source stream.
  int64_t max_side = 8192;
  int64_t max_source_frames = 2000000;
  double max_duration_s = 24 * 3600;
  double timeout_s = 300;              // one read's deadline
  // Throws dhp::Error naming the bad value as `prefix` + its name ("data.video_" + "fps").
  void validate(const std::string& prefix) const;
};

// What the container says of its video stream (frames counted from its packets).
struct VideoInfo {
  int64_t width = 0, height = 0;
  int64_t total_frames = 0;  // frames in the stream
  double fps = 0;            // average frame rate
  std::string codec, container;
};

// The frames [first, last] a video_start / video_end choose (qwen-vl-utils'
// calculate_video_frame_range): start at ceil(start * fps), end at floor(end * fps), each
// clamped to the video; the whole video when neither is set. Throws when the range is empty.
struct FrameRange {
  int64_t first = 0, last = 0;
  int64_t count() const { return last - first + 1; }
};
FrameRange frame_range(const VideoOptions& o, int64_t total_frames, double video_fps);

// qwen-vl-utils' smart_nframes over a range of `total_frames` frames at `video_fps`: nframes
// rounded to even when given, else total / video_fps * fps clamped to [min_frames,
// min(max_frames, total)] (rounded to even) and to the frames there are, rounded down to even.
// Throws unless 2 <= result <= total_frames.
int64_t smart_nframes(const VideoOptions& o, int64_t total_frames, double video_fps);

// round(linspace(first, last, n)) as torch computes it in float32, halves to even.
std::vector<int64_t> sample_indices(int64_t first, int64_t last, int64_t n);

// fetch_video's frame size (height, width) for nframes frames of height x width:
// smart_resize with factor 28 into [min_pixels, M], M = max(min(max_pixels, total_pixels /
// nframes * 2), int(min_pixels * 1.05)), or min(requested_max_pixels, M) when requested.
std::pair<int64_t, int64_t> video_frame_size(const VideoOptions& o, int64_t height, int64_t width, int64_t nframes,
                                             int64_t factor = 28);

// torchvision's resize(BICUBIC, antialias=True) of an 8-bit image: float32 antialiased
// bicubic interpolation, clamped, rounded half to even.
Image resize_bicubic_antialias(const Image& in, int64_t width, int64_t height);

// Probes `path` (container and stream, frames counted without decoding).
VideoInfo probe_video(const std::string& path, const VideoOptions& o = {});

// What fetch_video takes of a video: the sampled frames, their rate, the resized size.
struct VideoPlan {
  std::vector<int64_t> indices;
  double sample_fps = 0;        // nframes / range frames * video fps
  int64_t height = 0, width = 0;
};
// Throws dhp::Error naming the reason (no frames in the range, too few frames, ...).
VideoPlan plan_video(const VideoInfo& info, const VideoOptions& o, int64_t factor = 28);

// The processor's view of a plan: grid (nframes / temporal_patch_size rounded up, height /
// patch, width / patch) and seconds per temporal patch (float32, as its tensor holds them).
std::array<int64_t, 3> video_grid(const VideoPlan& plan, const ImageOptions& image);
float second_per_grid_t(const VideoPlan& plan, const ImageOptions& image);

struct VideoFrames {
  VideoInfo info;
  VideoPlan plan;
  std::vector<Image> frames;  // resized, one per plan.indices
};
// Reads, samples and resizes the frames of `path` as fetch_video does.
VideoFrames read_video(const std::string& path, const VideoOptions& o, int64_t factor = 28);

struct VideoPatches {
  torch::Tensor pixel_values;  // (grid_t * grid_h * grid_w, 3 * T * P * P) fp32
  std::array<int64_t, 3> grid{};
  float second_per_grid_t = 0;  // temporal_patch_size / sample_fps (float32, as the processor's tensor)
  VideoFrames frames;
};
// read_video, then the processor's rescale, normalisation and patches.
VideoPatches preprocess_video(const std::string& path, const VideoOptions& o, const ImageOptions& image);

// Writes `frames` (all of one size, 8-bit RGB) as a video with FFmpeg's encoder `codec`
// ("mpeg4", "libx264", "mjpeg", ...) in the container the file name says, at `fps`. For the
// synthetic task and the tests.
void write_video(const std::string& path, const std::vector<Image>& frames, double fps, const std::string& codec);
bool video_encoder_available(const std::string& codec);

}  // namespace dhp::data
