#include "dhp/data/image.h"

#include <jpeglib.h>
#include <png.h>
#include <torch/torch.h>

#include <cmath>
#include <csetjmp>
#include <cstring>
#include <fstream>
#include <sstream>

#include "dhp/core/error.h"
#include "dhp/data/shapes.h"
#include "dhp/io/safetensors.h"

namespace dhp::data {
namespace {

// ---- JPEG (libjpeg) ----------------------------------------------------------------------

struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_fail(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegError*>(c->err);
  (*c->err->format_message)(c, e->message);
  std::longjmp(e->jump, 1);
}

void jpeg_quiet(j_common_ptr, int) {}

// EXIF orientation (1..8) from a JPEG's APP1 segment; 1 when absent or unreadable.
int exif_orientation(const std::string& b) {
  size_t i = 2;
  while (i + 4 <= b.size() && static_cast<unsigned char>(b[i]) == 0xFF) {
    const auto marker = static_cast<unsigned char>(b[i + 1]);
    const size_t len = (static_cast<unsigned char>(b[i + 2]) << 8) | static_cast<unsigned char>(b[i + 3]);
    if (marker == 0xDA || len < 2 || i + 2 + len > b.size()) break;  // start of scan, or malformed
    if (marker == 0xE1 && len >= 16 && b.compare(i + 4, 6, std::string("Exif\0\0", 6)) == 0) {
      const size_t t = i + 10, end = i + 2 + len;  // TIFF header
      const bool le = b.compare(t, 2, "II") == 0;
      if (!le && b.compare(t, 2, "MM") != 0) return 1;
      auto u16 = [&](size_t p) -> uint32_t {
        if (p + 2 > end) return 0;
        const auto x = static_cast<unsigned char>(b[p]), y = static_cast<unsigned char>(b[p + 1]);
        return le ? (y << 8 | x) : (x << 8 | y);
      };
      auto u32 = [&](size_t p) -> uint32_t { return le ? (u16(p + 2) << 16 | u16(p)) : (u16(p) << 16 | u16(p + 2)); };
      const size_t ifd = t + u32(t + 4);
      const uint32_t n = u16(ifd);
      for (uint32_t k = 0; k < n; ++k) {
        const size_t e = ifd + 2 + 12 * k;
        if (e + 12 > end) break;
        if (u16(e) == 0x0112) {
          const uint32_t v = u16(e + 8);
          return v >= 1 && v <= 8 ? static_cast<int>(v) : 1;
        }
      }
      return 1;
    }
    i += 2 + len;
  }
  return 1;
}

Image decode_jpeg(const std::string& bytes, const std::string& what) {
  jpeg_decompress_struct c{};
  JpegError err{};
  c.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_quiet;
  Image img;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&c);
    DHP_FAIL(what, ": corrupt JPEG: ", err.message);
  }
  jpeg_create_decompress(&c);
  jpeg_mem_src(&c, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&c, TRUE);
  if (c.jpeg_color_space == JCS_CMYK || c.jpeg_color_space == JCS_YCCK) {
    jpeg_destroy_decompress(&c);
    DHP_FAIL(what, ": CMYK JPEGs are not supported");
  }
  c.out_color_space = JCS_RGB;
  jpeg_start_decompress(&c);
  img.width = c.output_width;
  img.height = c.output_height;
  img.rgb.resize(static_cast<size_t>(img.width * img.height * 3));
  while (c.output_scanline < c.output_height) {
    JSAMPROW row = img.rgb.data() + static_cast<size_t>(c.output_scanline) * static_cast<size_t>(img.width) * 3;
    jpeg_read_scanlines(&c, &row, 1);
  }
  jpeg_finish_decompress(&c);
  jpeg_destroy_decompress(&c);
  return img;
}

// ---- PNG (libpng's simplified API) ------------------------------------------------------

// transformers' convert_to_rgb: RGBA over opaque white, with Pillow's ImagingAlphaComposite
// arithmetic (7 extra bits, divisions by 255 by shifts).
uint8_t over_white(uint32_t c, uint32_t a) {
  if (a == 0) return 255;
  const uint32_t coef1 = a * 128, coef2 = (255 - a) * 128;  // dst alpha 255: outa255 = 255 * 255
  const uint32_t tmp = c * coef1 + 255 * coef2 + (0x80 << 7);
  return static_cast<uint8_t>((((tmp >> 8) + tmp) >> 8) >> 7);
}

Image decode_png(const std::string& bytes, const std::string& what) {
  png_image p{};
  p.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&p, bytes.data(), bytes.size())) {
    const std::string m = p.message;
    png_image_free(&p);
    DHP_FAIL(what, ": corrupt PNG: ", m);
  }
  const bool alpha = (p.format & PNG_FORMAT_FLAG_ALPHA) != 0;
  p.format = PNG_FORMAT_RGBA;
  std::vector<uint8_t> rgba(PNG_IMAGE_SIZE(p));
  if (!png_image_finish_read(&p, nullptr, rgba.data(), 0, nullptr)) {
    const std::string m = p.message;
    png_image_free(&p);
    DHP_FAIL(what, ": corrupt PNG: ", m);
  }
  Image img;
  img.width = p.width;
  img.height = p.height;
  img.rgb.resize(static_cast<size_t>(img.width * img.height * 3));
  for (size_t i = 0, n = static_cast<size_t>(img.width * img.height); i < n; ++i) {
    for (size_t ch = 0; ch < 3; ++ch) {
      img.rgb[3 * i + ch] = alpha ? over_white(rgba[4 * i + ch], rgba[4 * i + 3]) : rgba[4 * i + ch];
    }
  }
  return img;
}

// Pillow's ImageOps.exif_transpose for orientation `o`.
Image orient(const Image& in, int o) {
  if (o <= 1) return in;
  const bool swap = o >= 5;
  Image out;
  out.width = swap ? in.height : in.width;
  out.height = swap ? in.width : in.height;
  out.rgb.resize(in.rgb.size());
  for (int64_t y = 0; y < out.height; ++y) {
    for (int64_t x = 0; x < out.width; ++x) {
      int64_t sx = x, sy = y;  // source pixel of output (x, y)
      switch (o) {
        case 2: sx = in.width - 1 - x; break;                                  // mirror
        case 3: sx = in.width - 1 - x; sy = in.height - 1 - y; break;          // 180
        case 4: sy = in.height - 1 - y; break;                                 // flip
        case 5: sx = y; sy = x; break;                                         // transpose
        case 6: sx = y; sy = in.height - 1 - x; break;                         // 90 clockwise
        case 7: sx = in.width - 1 - y; sy = in.height - 1 - x; break;          // transverse
        case 8: sx = in.width - 1 - y; sy = x; break;                          // 90 counter-clockwise
        default: break;
      }
      std::memcpy(&out.rgb[static_cast<size_t>((y * out.width + x) * 3)],
                  &in.rgb[static_cast<size_t>((sy * in.width + sx) * 3)], 3);
    }
  }
  return out;
}

// ---- Pillow's resampling ----------------------------------------------------------------

constexpr int kPrecisionBits = 32 - 8 - 2;

double bicubic(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

struct Coeffs {
  int ksize = 0;
  std::vector<int> first, count;  // per output: first input index, number of taps
  std::vector<int32_t> k;          // fixed point, ksize per output
};

Coeffs coefficients(int64_t in_size, int64_t out_size) {
  const double scale = static_cast<double>(in_size) / static_cast<double>(out_size);
  const double filterscale = std::max(scale, 1.0);
  const double support = 2.0 * filterscale;
  Coeffs c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.k.assign(static_cast<size_t>(out_size * c.ksize), 0);
  std::vector<double> w(static_cast<size_t>(c.ksize));
  for (int64_t xx = 0; xx < out_size; ++xx) {
    const double center = (static_cast<double>(xx) + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = static_cast<int>(in_size);
    xmax -= xmin;
    double ww = 0;
    for (int x = 0; x < xmax; ++x) {
      w[static_cast<size_t>(x)] = bicubic((x + xmin - center + 0.5) * ss);
      ww += w[static_cast<size_t>(x)];
    }
    for (int x = 0; x < xmax; ++x) {
      const double v = ww != 0.0 ? w[static_cast<size_t>(x)] / ww : w[static_cast<size_t>(x)];
      c.k[static_cast<size_t>(xx * c.ksize + x)] =
          static_cast<int32_t>(v < 0 ? -0.5 + v * (1 << kPrecisionBits) : 0.5 + v * (1 << kPrecisionBits));
    }
    c.first.push_back(xmin);
    c.count.push_back(xmax);
  }
  return c;
}

uint8_t clip8(int32_t v) {
  const int32_t s = v >> kPrecisionBits;  // arithmetic shift, as Pillow's lookup index
  return static_cast<uint8_t>(s < 0 ? 0 : s > 255 ? 255 : s);
}

}  // namespace

Image decode_image(const std::string& bytes, const std::string& what) {
  DHP_CHECK(!bytes.empty(), what, ": empty file");
  if (bytes.size() >= 3 && static_cast<unsigned char>(bytes[0]) == 0xFF && static_cast<unsigned char>(bytes[1]) == 0xD8) {
    return orient(decode_jpeg(bytes, what), exif_orientation(bytes));
  }
  if (bytes.size() >= 8 && bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0) return decode_png(bytes, what);
  DHP_FAIL(what, ": not a JPEG or PNG file");
}

Image load_image(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DHP_CHECK(f.good(), path, ": cannot open the image");
  std::stringstream ss;
  ss << f.rdbuf();
  return decode_image(ss.str(), path);
}

void save_png(const Image& image, const std::string& path) {
  png_image p{};
  p.version = PNG_IMAGE_VERSION;
  p.width = static_cast<png_uint_32>(image.width);
  p.height = static_cast<png_uint_32>(image.height);
  p.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  DHP_CHECK(png_image_write_get_memory_size(p, size, 0, image.rgb.data(), 0, nullptr), path, ": cannot encode PNG: ",
            p.message);
  std::string bytes(size, '\0');
  DHP_CHECK(png_image_write_to_memory(&p, bytes.data(), &size, 0, image.rgb.data(), 0, nullptr), path,
            ": cannot encode PNG: ", p.message);
  bytes.resize(size);
  io::write_file_atomic(path, bytes);
}

std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor, double min_pixels,
                                         double max_pixels) {
  DHP_CHECK(height > 0 && width > 0, "image of ", width, "x", height, " pixels");
  DHP_CHECK(static_cast<double>(std::max(height, width)) / static_cast<double>(std::min(height, width)) <= 200,
            "image of ", width, "x", height, ": absolute aspect ratio must be at most 200");
  const auto f = static_cast<double>(factor);
  // Python's round() on a float: halves to even (the default rounding mode of nearbyint).
  int64_t h = static_cast<int64_t>(std::nearbyint(static_cast<double>(height) / f)) * factor;
  int64_t w = static_cast<int64_t>(std::nearbyint(static_cast<double>(width) / f)) * factor;
  const double hw = static_cast<double>(height * width);
  if (static_cast<double>(h * w) > max_pixels) {
    const double beta = std::sqrt(hw / max_pixels);
    h = std::max(factor, static_cast<int64_t>(std::floor(static_cast<double>(height) / beta / f)) * factor);
    w = std::max(factor, static_cast<int64_t>(std::floor(static_cast<double>(width) / beta / f)) * factor);
  } else if (static_cast<double>(h * w) < min_pixels) {
    const double beta = std::sqrt(min_pixels / hw);
    h = static_cast<int64_t>(std::ceil(static_cast<double>(height) * beta / f)) * factor;
    w = static_cast<int64_t>(std::ceil(static_cast<double>(width) * beta / f)) * factor;
  }
  return {h, w};
}

Image resize_bicubic(const Image& in, int64_t width, int64_t height) {
  DHP_CHECK(width > 0 && height > 0, "resize to ", width, "x", height);
  const Image* src = &in;
  Image tmp;
  const auto cv = coefficients(in.height, height);
  if (width != in.width) {
    // Horizontal pass over the rows the vertical pass reads.
    const auto ch = coefficients(in.width, width);
    tmp.width = width;
    tmp.height = in.height;
    tmp.rgb.assign(static_cast<size_t>(width * in.height * 3), 0);
    const int y0 = cv.first.front(), y1 = cv.first.back() + cv.count.back();
    for (int y = y0; y < y1; ++y) {
      const uint8_t* row = &in.rgb[static_cast<size_t>(y * in.width * 3)];
      for (int64_t xx = 0; xx < width; ++xx) {
        const int32_t* k = &ch.k[static_cast<size_t>(xx * ch.ksize)];
        const int xmin = ch.first[static_cast<size_t>(xx)], n = ch.count[static_cast<size_t>(xx)];
        for (int c = 0; c < 3; ++c) {
          int32_t s = 1 << (kPrecisionBits - 1);
          for (int x = 0; x < n; ++x) s += row[(x + xmin) * 3 + c] * k[x];
          tmp.rgb[static_cast<size_t>((y * width + xx) * 3 + c)] = clip8(s);
        }
      }
    }
    src = &tmp;
  }
  if (height == in.height) return src == &in ? in : tmp;
  Image out;
  out.width = width;
  out.height = height;
  out.rgb.resize(static_cast<size_t>(width * height * 3));
  for (int64_t yy = 0; yy < height; ++yy) {
    const int32_t* k = &cv.k[static_cast<size_t>(yy * cv.ksize)];
    const int ymin = cv.first[static_cast<size_t>(yy)], n = cv.count[static_cast<size_t>(yy)];
    for (int64_t xx = 0; xx < width; ++xx) {
      for (int c = 0; c < 3; ++c) {
        int32_t s = 1 << (kPrecisionBits - 1);
        for (int y = 0; y < n; ++y) s += src->rgb[static_cast<size_t>(((y + ymin) * width + xx) * 3 + c)] * k[y];
        out.rgb[static_cast<size_t>((yy * width + xx) * 3 + c)] = clip8(s);
      }
    }
  }
  return out;
}

qwen::VisionConfig patch_layout(const ImageOptions& o) {
  qwen::VisionConfig vc;
  vc.patch_size = o.patch_size;
  vc.spatial_merge_size = o.merge_size;
  vc.temporal_patch_size = o.temporal_patch_size;
  vc.in_channels = 3;
  return vc;
}

torch::Tensor normalize(const Image& image, const ImageOptions& o) {
  const int64_t h = image.height, w = image.width;
  DHP_CHECK(static_cast<int64_t>(image.rgb.size()) == h * w * 3, "normalize: an image of ", w, "x", h, " with ",
            image.rgb.size(), " bytes");
  // Rescale (float64 x 1/255, stored as float32) and normalise in float32, as numpy does.
  auto px = torch::empty({3, h, w}, torch::kFloat32);
  auto* p = px.data_ptr<float>();
  const double scale = 1.0 / 255.0;
  for (int64_t c = 0; c < 3; ++c) {
    for (int64_t i = 0; i < h * w; ++i) {
      const auto v = static_cast<float>(static_cast<double>(image.rgb[static_cast<size_t>(i * 3 + c)]) * scale);
      p[c * h * w + i] = (v - o.mean[static_cast<size_t>(c)]) / o.std[static_cast<size_t>(c)];
    }
  }
  return px;
}

Patches preprocess(const Image& image, const ImageOptions& o) {
  const int64_t factor = o.patch_size * o.merge_size;
  const auto [h, w] = smart_resize(image.height, image.width, factor, o.min_pixels, o.max_pixels);
  Patches out;
  out.resized = (h == image.height && w == image.width) ? image : resize_bicubic(image, w, h);
  const auto px = normalize(out.resized, o);
  // A still image is repeated to the temporal patch size; patches in merge-window order.
  qwen::GridTHW grid{};
  out.pixel_values = patchify(px, patch_layout(o), grid);
  out.grid = {grid[0], grid[1], grid[2]};
  return out;
}

}  // namespace dhp::data
