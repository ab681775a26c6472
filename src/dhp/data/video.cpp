#include "dhp/data/video.h"

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/imgutils.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>
}

#include <ATen/ops/_upsample_bicubic2d_aa.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <mutex>
#include <tuple>

#include "dhp/core/error.h"
#include "dhp/data/sample.h"

namespace dhp::data {
namespace {

constexpr int64_t kFrameFactor = 2;  // FRAME_FACTOR

std::string av_error(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(code, buf, sizeof(buf));
  return buf;
}

void quiet_ffmpeg() {
  static std::once_flag once;
  std::call_once(once, [] { av_log_set_level(AV_LOG_QUIET); });  // faults are reported by dhp, naming the file
}

// Python's round(x / f) * f, ceil and floor by factor (qwen-vl-utils' helpers).
int64_t round_by(double x, int64_t f) { return static_cast<int64_t>(std::nearbyint(x / static_cast<double>(f))) * f; }
int64_t ceil_by(double x, int64_t f) { return static_cast<int64_t>(std::ceil(x / static_cast<double>(f))) * f; }
int64_t floor_by(double x, int64_t f) { return static_cast<int64_t>(std::floor(x / static_cast<double>(f))) * f; }

struct Deadline {
  std::chrono::steady_clock::time_point at;
  static Deadline after(double seconds) {
    return {std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000))};
  }
  bool passed() const { return std::chrono::steady_clock::now() > at; }
};

// Bytes per row of an RGB24 buffer handed to swscale: padded to 64, since its SIMD paths may
// read or write past the end of a row.
int64_t padded_rgb_stride(int64_t width) { return (width * 3 + 63) / 64 * 64; }

int interrupt(void* opaque) { return static_cast<Deadline*>(opaque)->passed() ? 1 : 0; }

struct FormatCloser {
  void operator()(AVFormatContext* f) const { avformat_close_input(&f); }
};
struct CodecCloser {
  void operator()(AVCodecContext* c) const { avcodec_free_context(&c); }
};
struct PacketCloser {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct FrameCloser {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct SwsCloser {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};

// An opened container with its best video stream and the presentation times of its frames.
struct Opened {
  std::unique_ptr<AVFormatContext, FormatCloser> fmt;
  int stream = -1;
  VideoInfo info;
  std::vector<int64_t> pts;       // per frame, in presentation order (empty: unknown)
  std::vector<int64_t> key_pts;   // keyframes' pts, ascending
};

Opened open_video(const std::string& path, const VideoOptions& o, Deadline& deadline) {
  quiet_ffmpeg();
  DHP_CHECK(std::filesystem::is_regular_file(path), path, ": no such video file");
  Opened v;
  AVFormatContext* raw = avformat_alloc_context();
  DHP_CHECK(raw != nullptr, path, ": out of memory opening the video");
  raw->interrupt_callback.callback = interrupt;
  raw->interrupt_callback.opaque = &deadline;
  int rc = avformat_open_input(&raw, path.c_str(), nullptr, nullptr);  // frees raw on failure
  DHP_CHECK(rc >= 0, path, ": not a video FFmpeg can read (", av_error(rc), ")");
  v.fmt.reset(raw);
  rc = avformat_find_stream_info(raw, nullptr);
  DHP_CHECK(rc >= 0, path, ": cannot read the stream information (", av_error(rc), ")");
  v.stream = av_find_best_stream(raw, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
  DHP_CHECK(v.stream >= 0, path, ": has no video stream");
  const AVStream* st = raw->streams[v.stream];
  const AVCodecParameters* par = st->codecpar;
  v.info.width = par->width;
  v.info.height = par->height;
  v.info.container = raw->iformat && raw->iformat->name ? raw->iformat->name : "?";
  v.info.codec = avcodec_get_name(par->codec_id);
  DHP_CHECK(v.info.width > 0 && v.info.height > 0, path, ": the video stream has no frame size");
  DHP_CHECK(v.info.width <= o.max_side && v.info.height <= o.max_side, path, ": frames of ", v.info.width, "x",
            v.info.height, " exceed the limit of ", o.max_side, " pixels a side (data.video_max_side)");
  AVRational rate = st->avg_frame_rate.num > 0 && st->avg_frame_rate.den > 0 ? st->avg_frame_rate : st->r_frame_rate;
  DHP_CHECK(rate.num > 0 && rate.den > 0, path, ": the video stream has no frame rate");
  v.info.fps = av_q2d(rate);
  // Count the frames from the packets (no decoding); keep their times to seek by.
  std::unique_ptr<AVPacket, PacketCloser> pkt(av_packet_alloc());
  bool times = true;
  while (true) {
    rc = av_read_frame(raw, pkt.get());
    if (rc == AVERROR_EOF) break;
    DHP_CHECK(!deadline.passed(), path, ": reading took longer than ", o.timeout_s, " s (data.video_timeout_s)");
    DHP_CHECK(rc >= 0, path, ": unreadable after ", v.info.total_frames, " frames (", av_error(rc), ")");
    if (pkt->stream_index == v.stream) {
      ++v.info.total_frames;
      DHP_CHECK(v.info.total_frames <= o.max_source_frames, path, ": more than ", o.max_source_frames,
                " frames (data.video_max_source_frames)");
      if (pkt->pts == AV_NOPTS_VALUE) times = false;
      if (times) {
        v.pts.push_back(pkt->pts);
        if (pkt->flags & AV_PKT_FLAG_KEY) v.key_pts.push_back(pkt->pts);
      }
    }
    av_packet_unref(pkt.get());
  }
  DHP_CHECK(v.info.total_frames > 0, path, ": the video stream has no frames");
  const double seconds = static_cast<double>(v.info.total_frames) / v.info.fps;
  DHP_CHECK(seconds <= o.max_duration_s, path, ": ", seconds, " s of video exceed the limit of ", o.max_duration_s,
            " s (data.video_max_duration_s)");
  if (times) {
    std::sort(v.pts.begin(), v.pts.end());
    std::sort(v.key_pts.begin(), v.key_pts.end());
    if (std::adjacent_find(v.pts.begin(), v.pts.end()) != v.pts.end()) times = false;  // not one time per frame
  }
  if (!times) {
    v.pts.clear();
    v.key_pts.clear();
  }
  return v;
}

}  // namespace

FrameRange frame_range(const VideoOptions& o, int64_t total_frames, double video_fps) {
  DHP_CHECK(video_fps > 0, "video fps ", video_fps, " must be > 0");
  DHP_CHECK(total_frames > 0, "a video of ", total_frames, " frames");
  FrameRange r{0, total_frames - 1};
  if (o.start < 0 && o.end < 0) return r;
  const double duration = static_cast<double>(total_frames) / video_fps;
  if (o.start >= 0) r.first = static_cast<int64_t>(std::ceil(std::clamp(o.start, 0.0, duration) * video_fps));
  if (o.end >= 0) {
    r.last = std::min(static_cast<int64_t>(std::floor(std::clamp(o.end, 0.0, duration) * video_fps)), total_frames - 1);
  }
  DHP_CHECK(r.first < r.last, "video_start ", o.start, " s and video_end ", o.end, " s leave no frames (start frame ",
            r.first, ", end frame ", r.last, " of ", total_frames, " at ", video_fps, " fps)");
  return r;
}

int64_t smart_nframes(const VideoOptions& o, int64_t total_frames, double video_fps) {
  int64_t n = 0;
  if (o.nframes > 0) {
    n = round_by(static_cast<double>(o.nframes), kFrameFactor);
  } else {
    DHP_CHECK(o.fps > 0, "video fps ", o.fps, " must be > 0");
    const double min_frames = static_cast<double>(ceil_by(static_cast<double>(o.min_frames), kFrameFactor));
    const double max_frames =
        static_cast<double>(floor_by(static_cast<double>(std::min(o.max_frames, total_frames)), kFrameFactor));
    double x = static_cast<double>(total_frames) / video_fps * o.fps;
    x = std::min(std::min(std::max(x, min_frames), max_frames), static_cast<double>(total_frames));
    n = floor_by(x, kFrameFactor);
  }
  DHP_CHECK(n >= kFrameFactor && n <= total_frames, "nframes should be in [", kFrameFactor, ", ", total_frames,
            "] (the frames of the video or its range), got ", n);
  return n;
}

std::vector<int64_t> sample_indices(int64_t first, int64_t last, int64_t n) {
  DHP_CHECK(n >= 1, "sample_indices: ", n, " frames");
  auto t = torch::linspace(static_cast<double>(first), static_cast<double>(last), n,
                           torch::TensorOptions().dtype(torch::kFloat32))
               .round()
               .to(torch::kInt64)
               .contiguous();
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
}

std::pair<int64_t, int64_t> video_frame_size(const VideoOptions& o, int64_t height, int64_t width, int64_t nframes,
                                             int64_t factor) {
  DHP_CHECK(nframes > 0, "video_frame_size: ", nframes, " frames");
  const double budget = std::min(o.max_pixels, o.total_pixels / static_cast<double>(nframes) * kFrameFactor);
  double max_pixels = std::max(budget, static_cast<double>(static_cast<int64_t>(o.min_pixels * 1.05)));
  if (o.requested_max_pixels > 0) max_pixels = std::min(o.requested_max_pixels, max_pixels);
  return smart_resize(height, width, factor, o.min_pixels, max_pixels);
}

Image resize_bicubic_antialias(const Image& in, int64_t width, int64_t height) {
  DHP_CHECK(width > 0 && height > 0 && static_cast<int64_t>(in.rgb.size()) == in.width * in.height * 3,
            "resize of a ", in.width, "x", in.height, " image to ", width, "x", height);
  auto x = torch::from_blob(const_cast<uint8_t*>(in.rgb.data()), {1, in.height, in.width, 3}, torch::kUInt8)
               .permute({0, 3, 1, 2})
               .to(torch::kFloat32);
  auto y = at::_upsample_bicubic2d_aa(x, {height, width}, /*align_corners=*/false);
  y = y.clamp(0, 255).round().to(torch::kUInt8).permute({0, 2, 3, 1}).contiguous();
  Image out;
  out.width = width;
  out.height = height;
  out.rgb.assign(y.data_ptr<uint8_t>(), y.data_ptr<uint8_t>() + y.numel());
  return out;
}

void VideoOptions::validate(const std::string& prefix) const {
  DHP_CHECK(fps > 0 && std::isfinite(fps), prefix, "fps=", fps, " must be > 0");
  DHP_CHECK(nframes >= 0, prefix, "nframes=", nframes, " must be >= 0 (0: by fps)");
  DHP_CHECK(min_frames >= 1 && max_frames >= min_frames, prefix, "min_frames=", min_frames, " and ", prefix,
            "max_frames=", max_frames, " must satisfy 1 <= min <= max");
  DHP_CHECK(min_pixels > 0 && max_pixels >= min_pixels, prefix, "min_pixels=", min_pixels, " and ", prefix,
            "max_pixels=", max_pixels, " must satisfy 0 < min <= max");
  DHP_CHECK(total_pixels > 0, prefix, "total_pixels=", total_pixels, " must be > 0");
  DHP_CHECK(max_side > 0 && max_source_frames > 0 && max_duration_s > 0 && timeout_s > 0, prefix, "max_side, ",
            prefix, "max_duration_s and ", prefix, "timeout_s must be > 0");
}

VideoPlan plan_video(const VideoInfo& info, const VideoOptions& o, int64_t factor) {
  const auto range = frame_range(o, info.total_frames, info.fps);
  const int64_t n = smart_nframes(o, range.count(), info.fps);
  VideoPlan p;
  p.indices = sample_indices(range.first, range.last, n);
  p.sample_fps = static_cast<double>(n) / std::max(static_cast<double>(range.count()), 1e-6) * info.fps;
  std::tie(p.height, p.width) = video_frame_size(o, info.height, info.width, n, factor);
  return p;
}

std::array<int64_t, 3> video_grid(const VideoPlan& plan, const ImageOptions& image) {
  const auto n = static_cast<int64_t>(plan.indices.size());
  const int64_t T = image.temporal_patch_size;
  return {(n + T - 1) / T, plan.height / image.patch_size, plan.width / image.patch_size};
}

float second_per_grid_t(const VideoPlan& plan, const ImageOptions& image) {
  // The processor: second_per_grid_ts = temporal_patch_size / fps, held as a float32 tensor.
  return static_cast<float>(static_cast<double>(image.temporal_patch_size) / plan.sample_fps);
}

VideoInfo probe_video(const std::string& path, const VideoOptions& o) {
  Deadline deadline = Deadline::after(o.timeout_s);
  return open_video(path, o, deadline).info;
}

VideoFrames read_video(const std::string& path, const VideoOptions& o, int64_t factor) {
  Deadline deadline = Deadline::after(o.timeout_s);
  Opened v = open_video(path, o, deadline);
  VideoFrames out;
  out.info = v.info;
  try {
    out.plan = plan_video(v.info, o, factor);
  } catch (const Error& e) {
    DHP_FAIL(path, " (", v.info.total_frames, " frames at ", v.info.fps, " fps): ", e.what());
  }
  const int64_t rh = out.plan.height, rw = out.plan.width;
  const auto& indices = out.plan.indices;

  AVFormatContext* fmt = v.fmt.get();
  AVStream* st = fmt->streams[v.stream];
  const AVCodec* codec = avcodec_find_decoder(st->codecpar->codec_id);
  DHP_CHECK(codec != nullptr, path, ": FFmpeg here has no decoder for the codec ", v.info.codec);
  std::unique_ptr<AVCodecContext, CodecCloser> dec(avcodec_alloc_context3(codec));
  DHP_CHECK(dec != nullptr, path, ": out of memory opening the decoder");
  int rc = avcodec_parameters_to_context(dec.get(), st->codecpar);
  DHP_CHECK(rc >= 0, path, ": bad codec parameters (", av_error(rc), ")");
  dec->thread_count = 1;  // the loader's worker threads are the parallelism
  rc = avcodec_open2(dec.get(), codec, nullptr);
  DHP_CHECK(rc >= 0, path, ": cannot open the ", v.info.codec, " decoder (", av_error(rc), ")");

  // Back to the start, then decode forward; jump to the keyframe before a wanted frame when
  // one lies beyond the frames decoded so far.
  rc = av_seek_frame(fmt, v.stream, v.pts.empty() ? 0 : v.pts.front(), AVSEEK_FLAG_BACKWARD);
  if (rc < 0) rc = avformat_seek_file(fmt, v.stream, INT64_MIN, 0, 0, 0);
  DHP_CHECK(rc >= 0, path, ": cannot seek back to the start (", av_error(rc), ")");
  avcodec_flush_buffers(dec.get());

  std::unique_ptr<AVPacket, PacketCloser> pkt(av_packet_alloc());
  std::unique_ptr<AVFrame, FrameCloser> frame(av_frame_alloc());
  std::unique_ptr<SwsContext, SwsCloser> sws;
  const bool timed = !v.pts.empty();
  int64_t sequential = 0;         // frames decoded, when the stream has no usable times
  int64_t decoded_pts = INT64_MIN;  // the last decoded frame's time
  size_t want = 0;                // next index of indices
  bool draining = false;
  out.frames.reserve(indices.size());

  std::vector<uint8_t> scratch;  // swscale's output, rows of padded_rgb_stride
  auto keep = [&](const AVFrame* f) {
    const int64_t stride = padded_rgb_stride(f->width);
    scratch.resize(static_cast<size_t>(stride * f->height + 64));
    sws.reset(sws_getCachedContext(sws.release(), f->width, f->height, static_cast<AVPixelFormat>(f->format), f->width,
                                   f->height, AV_PIX_FMT_RGB24, SWS_BILINEAR, nullptr, nullptr, nullptr));
    DHP_CHECK(sws != nullptr, path, ": cannot convert frames of pixel format ",
              av_get_pix_fmt_name(static_cast<AVPixelFormat>(f->format)), " to RGB");
    uint8_t* dst[4] = {scratch.data(), nullptr, nullptr, nullptr};
    int dst_stride[4] = {static_cast<int>(stride), 0, 0, 0};
    sws_scale(sws.get(), f->data, f->linesize, 0, f->height, dst, dst_stride);
    Image rgb;
    rgb.width = f->width;
    rgb.height = f->height;
    rgb.rgb.resize(static_cast<size_t>(f->width) * static_cast<size_t>(f->height) * 3);
    for (int64_t y = 0; y < f->height; ++y) {
      std::copy_n(scratch.data() + y * stride, f->width * 3, rgb.rgb.data() + y * f->width * 3);
    }
    out.frames.push_back(rgb.width == rw && rgb.height == rh ? std::move(rgb) : resize_bicubic_antialias(rgb, rw, rh));
  };
  // The frame index of a decoded frame.
  auto index_of = [&](const AVFrame* f) -> int64_t {
    if (!timed) return sequential++;
    const int64_t t = f->best_effort_timestamp != AV_NOPTS_VALUE ? f->best_effort_timestamp : f->pts;
    decoded_pts = t;
    auto it = std::lower_bound(v.pts.begin(), v.pts.end(), t);
    if (it == v.pts.end() || *it != t) return -1;  // a time no packet had: not a frame of the count
    return it - v.pts.begin();
  };
  auto maybe_seek = [&]() {
    if (!timed || want >= indices.size()) return;
    const int64_t target = v.pts[static_cast<size_t>(indices[want])];
    auto k = std::upper_bound(v.key_pts.begin(), v.key_pts.end(), target);
    if (k == v.key_pts.begin()) return;
    const int64_t key = *(k - 1);
    if (key <= decoded_pts) return;  // decoding on reaches the target without skipping a keyframe
    if (av_seek_frame(fmt, v.stream, key, AVSEEK_FLAG_BACKWARD) >= 0) {
      avcodec_flush_buffers(dec.get());
      decoded_pts = key - 1;
    }
  };
  maybe_seek();
  while (want < indices.size()) {
    DHP_CHECK(!deadline.passed(), path, ": decoding took longer than ", o.timeout_s, " s (data.video_timeout_s)");
    if (!draining) {
      rc = av_read_frame(fmt, pkt.get());
      if (rc == AVERROR_EOF) {
        draining = true;
        rc = avcodec_send_packet(dec.get(), nullptr);
      } else {
        DHP_CHECK(rc >= 0, path, ": unreadable at frame ", indices[want], " (", av_error(rc), ")");
        if (pkt->stream_index != v.stream) {
          av_packet_unref(pkt.get());
          continue;
        }
        rc = avcodec_send_packet(dec.get(), pkt.get());
        av_packet_unref(pkt.get());
      }
      DHP_CHECK(rc >= 0 || rc == AVERROR(EAGAIN) || rc == AVERROR_EOF, path, ": corrupt video data near frame ",
                indices[want], " (", av_error(rc), ")");
    }
    while (want < indices.size()) {
      rc = avcodec_receive_frame(dec.get(), frame.get());
      if (rc == AVERROR(EAGAIN)) break;
      if (rc == AVERROR_EOF) {
        DHP_FAIL(path, ": the stream ends before frame ", indices[want], " of the ", v.info.total_frames,
                 " its container lists (", out.frames.size(), " of ", indices.size(),
                 " sampled frames decoded; a truncated file?)");
      }
      DHP_CHECK(rc >= 0, path, ": corrupt video data near frame ", indices[want], " (", av_error(rc), ")");
      const int64_t i = index_of(frame.get());
      while (want < indices.size() && i == indices[want]) {
        if (out.frames.size() > want) {
          out.frames.push_back(out.frames.back());
        } else {
          keep(frame.get());
        }
        ++want;
      }
      av_frame_unref(frame.get());
      DHP_CHECK(want >= indices.size() || i < indices[want] || i < 0, path, ": frame ", indices[want],
                " was not decoded (the decoder went from before it to frame ", i, ")");
      if (!draining) maybe_seek();
    }
    if (draining && want < indices.size() && rc == AVERROR(EAGAIN)) {
      DHP_FAIL(path, ": the decoder stopped before frame ", indices[want]);
    }
  }
  return out;
}

VideoPatches preprocess_video(const std::string& path, const VideoOptions& o, const ImageOptions& image) {
  VideoPatches p;
  p.frames = read_video(path, o, image.patch_size * image.merge_size);
  std::vector<torch::Tensor> frames;
  frames.reserve(p.frames.frames.size());
  for (const auto& f : p.frames.frames) frames.push_back(normalize(f, image));
  qwen::GridTHW grid{};
  p.pixel_values = patchify_frames(torch::stack(frames), patch_layout(image), grid);
  p.grid = {grid[0], grid[1], grid[2]};
  p.second_per_grid_t = second_per_grid_t(p.frames.plan, image);
  return p;
}

bool video_encoder_available(const std::string& codec) {
  quiet_ffmpeg();
  return avcodec_find_encoder_by_name(codec.c_str()) != nullptr;
}

void write_video(const std::string& path, const std::vector<Image>& frames, double fps, const std::string& codec_name) {
  quiet_ffmpeg();
  const AVRational rate = av_d2q(fps, 1001000);
  DHP_CHECK(rate.num > 0 && rate.den > 0, "write_video ", path, ": fps ", fps);
  DHP_CHECK(!frames.empty(), "write_video ", path, ": no frames");
  const int64_t W = frames[0].width, H = frames[0].height;
  for (const auto& f : frames) {
    DHP_CHECK(f.width == W && f.height == H && static_cast<int64_t>(f.rgb.size()) == W * H * 3, "write_video ", path,
              ": frames of different sizes");
  }
  AVFormatContext* raw = nullptr;
  int rc = avformat_alloc_output_context2(&raw, nullptr, nullptr, path.c_str());
  DHP_CHECK(rc >= 0 && raw != nullptr, path, ": FFmpeg knows no container for this file name (", av_error(rc), ")");
  struct OutCloser {
    void operator()(AVFormatContext* f) const {
      if (f->pb && !(f->oformat->flags & AVFMT_NOFILE)) avio_closep(&f->pb);
      avformat_free_context(f);
    }
  };
  std::unique_ptr<AVFormatContext, OutCloser> fmt(raw);
  const AVCodec* codec = avcodec_find_encoder_by_name(codec_name.c_str());
  DHP_CHECK(codec != nullptr, "FFmpeg here has no encoder '", codec_name, "'");
  AVStream* st = avformat_new_stream(raw, nullptr);
  std::unique_ptr<AVCodecContext, CodecCloser> enc(avcodec_alloc_context3(codec));
  DHP_CHECK(st != nullptr && enc != nullptr, path, ": out of memory");
  enc->width = static_cast<int>(W);
  enc->height = static_cast<int>(H);
  enc->time_base = av_inv_q(rate);
  enc->framerate = rate;
  enc->gop_size = 8;
  enc->max_b_frames = 0;
  enc->bit_rate = 2000000;
  enc->thread_count = 1;
  enc->pix_fmt = codec->id == AV_CODEC_ID_MJPEG ? AV_PIX_FMT_YUVJ420P : AV_PIX_FMT_YUV420P;
  if (codec->id == AV_CODEC_ID_H264) av_opt_set(enc->priv_data, "preset", "veryfast", 0);
  if (raw->oformat->flags & AVFMT_GLOBALHEADER) enc->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  rc = avcodec_open2(enc.get(), codec, nullptr);
  DHP_CHECK(rc >= 0, path, ": cannot open the encoder ", codec_name, " (", av_error(rc), ")");
  rc = avcodec_parameters_from_context(st->codecpar, enc.get());
  DHP_CHECK(rc >= 0, path, ": ", av_error(rc));
  st->time_base = enc->time_base;
  st->avg_frame_rate = enc->framerate;
  const std::string tmp = path + ".tmp" + std::filesystem::path(path).extension().string();
  rc = avio_open(&raw->pb, tmp.c_str(), AVIO_FLAG_WRITE);
  DHP_CHECK(rc >= 0, tmp, ": cannot open for writing (", av_error(rc), ")");
  rc = avformat_write_header(raw, nullptr);
  DHP_CHECK(rc >= 0, path, ": cannot write the header (", av_error(rc), ")");
  std::unique_ptr<AVFrame, FrameCloser> frame(av_frame_alloc());
  frame->format = enc->pix_fmt;
  frame->width = enc->width;
  frame->height = enc->height;
  rc = av_frame_get_buffer(frame.get(), 0);
  DHP_CHECK(rc >= 0, path, ": ", av_error(rc));
  std::unique_ptr<SwsContext, SwsCloser> sws(sws_getContext(enc->width, enc->height, AV_PIX_FMT_RGB24, enc->width,
                                                            enc->height, enc->pix_fmt, SWS_BICUBIC, nullptr, nullptr,
                                                            nullptr));
  std::unique_ptr<AVPacket, PacketCloser> pkt(av_packet_alloc());
  auto drain = [&]() {
    while (true) {
      int r = avcodec_receive_packet(enc.get(), pkt.get());
      if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) return;
      DHP_CHECK(r >= 0, path, ": encoding failed (", av_error(r), ")");
      av_packet_rescale_ts(pkt.get(), enc->time_base, st->time_base);
      pkt->stream_index = st->index;
      r = av_interleaved_write_frame(raw, pkt.get());
      DHP_CHECK(r >= 0, path, ": writing failed (", av_error(r), ")");
    }
  };
  const int64_t stride = padded_rgb_stride(W);
  std::vector<uint8_t> padded(static_cast<size_t>(stride * H + 64));
  for (size_t i = 0; i < frames.size(); ++i) {
    rc = av_frame_make_writable(frame.get());
    DHP_CHECK(rc >= 0, path, ": ", av_error(rc));
    for (int64_t y = 0; y < H; ++y) std::copy_n(frames[i].rgb.data() + y * W * 3, W * 3, padded.data() + y * stride);
    const uint8_t* src[4] = {padded.data(), nullptr, nullptr, nullptr};
    int src_stride[4] = {static_cast<int>(stride), 0, 0, 0};
    sws_scale(sws.get(), src, src_stride, 0, enc->height, frame->data, frame->linesize);
    frame->pts = static_cast<int64_t>(i);
    rc = avcodec_send_frame(enc.get(), frame.get());
    DHP_CHECK(rc >= 0, path, ": encoding failed (", av_error(rc), ")");
    drain();
  }
  rc = avcodec_send_frame(enc.get(), nullptr);
  DHP_CHECK(rc >= 0, path, ": ", av_error(rc));
  drain();
  rc = av_write_trailer(raw);
  DHP_CHECK(rc >= 0, path, ": cannot write the trailer (", av_error(rc), ")");
  avio_closep(&raw->pb);
  std::filesystem::rename(tmp, path);
}

}  // namespace dhp::data
