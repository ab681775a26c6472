// The resolved run configuration: every section of a dhp YAML config as typed options
// with defaults. Load with load_config(); unknown keys and bad values are errors naming
// the key and the file (or --set) they came from.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "dhp/core/options.h"
#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/models/qwen2_5_vl/freezing.h"
#include "dhp/models/qwen2_5_vl/lora.h"

namespace dhp {

struct ModelOptions {
  std::string preset = "demo";  // demo, bench, qwen2.5-vl-3b, -7b, -32b, -72b
  std::string from;             // Hugging Face model directory to start from (replaces preset)
  qwen::ModelConfig config;     // the preset (or from's config.json), with any model.vision.* / model.text.* override
  qwen::Freezing freezing;      // fine-tuning: what trains (model.vision.freeze, ...)
  template <class V>
  void visit(V& v) {
    v.field("preset", preset, "demo, bench, qwen2.5-vl-3b, qwen2.5-vl-7b, qwen2.5-vl-32b, qwen2.5-vl-72b");
    v.field("from", from,
            "Hugging Face model directory (config.json + model.safetensors or a sharded index) whose architecture "
            "and weights training starts from; replaces model.preset (empty = initialise from training.seed)");
    Joined<qwen::VisionConfig, qwen::VisionFreezing> vision{config.vision, freezing.vision};
    Joined<qwen::TextConfig, qwen::TextFreezing> text{config.text, freezing.text};
    v.section("vision", vision, "vision tower: architecture, and what trains (fine-tuning)");
    v.section("text", text, "text decoder: architecture, and what trains (fine-tuning)");
    v.section("merger", freezing.merger, "vision merger (fine-tuning)");
    config.visit_fields(v);
  }
};

struct DataOptions {
  std::string dataset = "shapes";  // built-in synthetic task, or llava (files)
  int64_t batch_size = 16;         // global batch: samples per optimizer step
  int64_t pack_tokens = 0;         // > 0: micro-batches packed to this many tokens instead
  int64_t eval_samples = 256;      // held-out samples for the final evaluation
  int64_t min_side = 112;          // synthetic image side range (pixels)
  int64_t max_side = 224;
  int64_t seed = 1234;             // dataset seed (held-out set uses a different stream)
  int64_t frames = 0;              // shapes: > 0: the moving task, clips of this many frames at 2 fps
  // dataset: llava
  std::vector<std::string> files;  // annotation files (JSON or JSONL)
  std::vector<double> fractions;   // per file: records per epoch = fraction x records (empty = all 1)
  std::vector<std::string> eval_files;  // held-out annotation files (empty = no evaluation)
  std::string root;                // image root (empty: each file's directory)
  std::string tokenizer = "third_party/qwen-tokenizer/tokenizer.json";
  int64_t max_length = 2048;       // tokens per sample (longer: cut after the last image, or skipped)
  int64_t min_pixels = 3136;       // image resize range (Qwen2.5-VL's preprocessor defaults)
  int64_t max_pixels = 12845056;
  // Videos (qwen-vl-utils' defaults; a record's own fps, nframes, min_pixels, max_pixels,
  // total_pixels, video_start and video_end win).
  double video_fps = 2.0;
  int64_t video_nframes = 0;
  int64_t video_min_frames = 4;
  int64_t video_max_frames = 768;
  int64_t video_min_pixels = 128 * 28 * 28;
  int64_t video_max_pixels = 768 * 28 * 28;
  int64_t video_total_pixels = 90316800;
  int64_t video_max_side = 8192;          // refused before decoding: larger frames,
  double video_max_duration_s = 86400;    // longer videos,
  double video_timeout_s = 300;           // and reads that take longer
  int64_t workers = 2;             // image and video decoding threads per process
  int64_t prefetch = 16;           // samples decoded ahead
  bool strict = false;             // a bad record or sample stops the run (default: skipped, counted)
  template <class V>
  void visit(V& v) {
    v.field("dataset", dataset, "dataset: shapes (built-in synthetic task) or llava (data.files)");
    v.field("batch_size", batch_size, "global batch size (samples per optimizer step); unused with pack_tokens");
    v.field("pack_tokens", pack_tokens, "token budget per micro-batch (0 = off): samples are packed in stream order "
            "while the micro-batch stays within it, at least one per data-parallel replica");
    v.field("eval_samples", eval_samples, "held-out samples evaluated at the end (0 = none)");
    v.field("min_side", min_side, "smallest synthetic image side in pixels");
    v.field("max_side", max_side, "largest synthetic image side in pixels");
    v.field("seed", seed, "dataset seed");
    v.field("frames", frames, "shapes: > 0: the moving task instead of images, clips of this many frames (even) at 2 fps");
    v.field("files", files, "llava: annotation files, JSON arrays or JSONL of {image, conversations}");
    v.field("fractions", fractions, "llava: per file, records drawn per epoch as a fraction of its records (empty = 1 each)");
    v.field("eval_files", eval_files, "llava: held-out annotation files evaluated at the end (up to eval_samples; empty = none)");
    v.field("root", root, "llava: directory the image paths are relative to (empty = each file's directory)");
    v.field("tokenizer", tokenizer, "llava: Hugging Face tokenizer.json (Qwen2 family; scripts/fetch_tokenizer.sh)");
    v.field("max_length", max_length, "llava: tokens per sample; longer ones are cut after their last image or skipped");
    v.field("min_pixels", min_pixels, "llava: smallest resized image area in pixels");
    v.field("max_pixels", max_pixels, "llava: largest resized image area in pixels");
    v.field("video_fps", video_fps, "llava: video frames sampled per second (qwen-vl-utils' FPS)");
    v.field("video_nframes", video_nframes, "llava: > 0: frames sampled per video instead of video_fps");
    v.field("video_min_frames", video_min_frames, "llava: fewest frames sampled by video_fps");
    v.field("video_max_frames", video_max_frames, "llava: most frames sampled by video_fps");
    v.field("video_min_pixels", video_min_pixels, "llava: smallest resized video frame area in pixels");
    v.field("video_max_pixels", video_max_pixels, "llava: largest resized video frame area in pixels");
    v.field("video_total_pixels", video_total_pixels, "llava: pixel budget of all of a video's frames together");
    v.field("video_max_side", video_max_side, "llava: videos with a larger frame side are refused before decoding");
    v.field("video_max_duration_s", video_max_duration_s, "llava: longer videos are refused before decoding");
    v.field("video_timeout_s", video_timeout_s, "llava: a video read taking longer fails (a bad sample)");
    v.field("workers", workers, "llava: image and video decoding threads per process");
    v.field("prefetch", prefetch, "llava: samples prepared ahead of the trainer");
    v.field("strict", strict, "llava: stop at the first bad record or sample instead of skipping and counting it");
  }
};

struct TrainingOptions {
  int64_t steps = 600;                    // optimizer steps
  int64_t seed = 0;                       // parameter init seed
  int64_t micro_batches = 1;              // gradient accumulation: micro-batches per step
  std::string precision = "fp32";         // fp32 or bf16 (bf16 compute, fp32 master weights)
  bool activation_checkpointing = false;  // recompute each layer in backward
  double lr = 3e-3;                       // peak learning rate
  double min_lr = 1e-4;                   // cosine floor
  int64_t warmup_steps = 20;              // linear warm-up steps
  double weight_decay = 0.05;             // AdamW decoupled decay (not on norms and biases)
  // Per module (-1: the defaults above): the vision tower (its blocks and patch embedding),
  // its merger (the projector into the text width), the text decoder (embeddings and lm_head).
  double lr_vision = -1, lr_merger = -1, lr_text = -1;
  double weight_decay_vision = -1, weight_decay_merger = -1, weight_decay_text = -1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;                 // max global grad norm (0 = off)
  std::string device = "cpu";             // cpu, cuda or cuda:N (see train::place_rank)
  int64_t threads = 0;                    // intra-op threads (0 = all cores)
  int64_t attention_block = 256;          // attention block length
  std::string attention = "auto";         // auto | dhp | flash (nn::AttentionKernel)
  std::string memory_limit = "0";         // per-process CPU tensor budget, e.g. 8GiB (0 = none)
  int64_t log_every = 10;                 // progress lines when stderr is not a terminal
  int64_t profile_every = 0;              // steps between profiled steps (0: none)
  template <class V>
  void visit(V& v) {
    v.field("steps", steps, "optimizer steps");
    v.field("seed", seed, "parameter init seed");
    v.field("micro_batches", micro_batches, "micro-batches per step (gradient accumulation)");
    v.field("precision", precision, "fp32 or bf16 (bf16 compute, fp32 master weights and optimizer state)");
    v.field("activation_checkpointing", activation_checkpointing, "recompute each layer in backward");
    v.field("lr", lr, "peak learning rate");
    v.field("min_lr", min_lr, "learning rate at the end of the cosine decay");
    v.field("warmup_steps", warmup_steps, "linear warm-up steps");
    v.field("weight_decay", weight_decay, "AdamW decoupled weight decay (none on norms and biases)");
    v.field("lr_vision", lr_vision,
            "peak learning rate of the vision tower's blocks and patch embedding (-1: training.lr); the same "
            "warm-up and decay, scaled (min_lr too)");
    v.field("lr_merger", lr_merger, "peak learning rate of the vision merger (the projector; -1: training.lr)");
    v.field("lr_text", lr_text, "peak learning rate of the text decoder, embeddings and lm_head (-1: training.lr)");
    v.field("weight_decay_vision", weight_decay_vision, "weight decay of the vision tower (-1: training.weight_decay)");
    v.field("weight_decay_merger", weight_decay_merger, "weight decay of the vision merger (-1: training.weight_decay)");
    v.field("weight_decay_text", weight_decay_text, "weight decay of the text decoder (-1: training.weight_decay)");
    v.field("beta1", beta1, "AdamW beta1");
    v.field("beta2", beta2, "AdamW beta2");
    v.field("eps", eps, "AdamW epsilon");
    v.field("grad_clip", grad_clip, "clip gradients to this global norm (0 = off)");
    v.field("device", device, "where the model and its tensors live: cpu, cuda (each rank on cuda:LOCAL_RANK; with parallel.backend=gloo ranks may share GPUs) or cuda:N (every rank on GPU N: one rank, or Gloo)");
    v.field("threads", threads, "intra-op threads (0 = all cores)");
    v.field("attention_block", attention_block, "attention block length (flash-style tiling)");
    v.field("attention", attention,
            "attention kernel: auto (libtorch's flash kernel on CUDA in bf16/fp16 with libtorch 2.4+, dhp's "
            "otherwise; a fallback on a GPU is logged once), dhp, or flash (an error where it cannot run)");
    v.field("memory_limit", memory_limit, "CPU tensor memory budget, e.g. 8GiB (0 = unlimited)");
    v.field("log_every", log_every, "steps between progress lines when not on a terminal");
    v.field("profile_every", profile_every,
            "profile every Nth step (0: never): its metrics.jsonl line breaks the step down per rank into GEMM, "
            "attention, element-wise, communication wait, optimizer update and data time (the profiler slows that "
            "step down, so it is left out of the throughput)");
  }
};

// parallel.strategy: a named combination of module strategies.
enum class Combination {
  kNone,    // none: one process
  kDhp,     // dhp: sp (+ZeRO-1) where a module supports it (vision), tp elsewhere (text)
  kTp,      // tp: every module tp
  kZero3,   // zero3: every module zero3
  kDp,      // dp: every module data-parallel
  kCustom,  // custom: parallel.<module>.strategy says, for every module
  kAuto,    // auto: the planner picks (train/auto_plan.h), before the workers start
};
// Parses parallel.strategy; throws dhp::Error naming the key, the value and the valid names.
Combination parse_combination(const std::string& value);
const char* combination_name(Combination c);

// One module's strategy and degrees; empty / 0 / -1 = derived from parallel.strategy and
// the number of ranks (see resolve_layouts).
struct ModuleParallelOptions {
  std::string strategy;         // vision: none, sp, tp, zero3, dp; text: none, tp, zero3, dp
  std::vector<int64_t> ranks;   // global ranks of the module (empty = every rank)
  int64_t sp = 0, tp = 0, dp = 0;
  int64_t zero = -1;
  template <class V>
  void visit(V& v) {
    v.field("strategy", strategy, "this module's strategy (empty = from parallel.strategy)");
    v.field("ranks", ranks, "global ranks this module runs on, in module-rank order (empty = all ranks)");
    v.field("sp", sp, "sequence-parallel degree (0 = derived)");
    v.field("tp", tp, "tensor-parallel degree (0 = derived)");
    v.field("dp", dp, "data-parallel replicas (0 = derived)");
    v.field("zero", zero, "ZeRO stage 0, 1 or 3 (-1 = derived: 1 for sp, 3 for zero3, else 0)");
  }
};

struct ParallelOptions {
  std::string strategy = "none";
  std::string backend = "auto";  // auto | nccl | gloo (see train::place_rank)
  double timeout_s = 300;  // collective / rendezvous timeout
  std::string socket_ifname;  // interfaces of a multi-host job's Gloo groups ("" = derived)
  bool pipeline = true;    // pipeline micro-batches between disjoint vision and text ranks
  std::string balance = "cost";  // cost | contiguous: how a micro-batch's samples go to data-parallel replicas
  bool overlap = true;     // gradient reductions start during the step's last backward
  double bucket_mb = 25;   // MiB of gradients per reduction bucket
  int64_t buckets_in_flight = 2;  // reduction buckets started and not yet landed at once
  ModuleParallelOptions vision, text;
  // timeout_s as the collectives and the launcher take it.
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  }
  template <class V>
  void visit(V& v) {
    v.field("strategy", strategy,
            "none (one process), dhp (vision sp + ZeRO-1, text tp), tp (both tp), zero3 (both zero3), "
            "dp (both data-parallel), custom (parallel.vision / parallel.text say) or auto (the planner picks the "
            "fastest layout that fits this machine, and its training.micro_batches unless packing, from dhp plan "
            "--calibrate; logged with the reason)");
    v.field("backend", backend,
            "what the module groups and the transfers communicate on: auto (NCCL on CUDA, Gloo on the CPU), nccl "
            "or gloo (on CUDA: through host copies, so that ranks may share a GPU; for tests). Host bookkeeping "
            "(loss sums, counts, barriers) always runs on a small Gloo group");
    v.field("timeout_s", timeout_s, "seconds a collective or the rendezvous may wait before the job fails");
    v.field("socket_ifname", socket_ifname,
            "network interfaces (comma-separated) the Gloo groups of a job spanning hosts connect over; empty: the "
            "interface on the route to MASTER_ADDR. GLOO_SOCKET_IFNAME, set per host, wins. A job on one host "
            "stays on loopback");
    v.field("pipeline", pipeline,
            "when vision and text run on disjoint ranks, encode micro-batch i+1 while the text ranks work on i "
            "(false: one after the other)");
    v.field("balance", balance,
            "how each module gives a micro-batch's samples to its data-parallel replicas: cost (by the forward FLOPs "
            "of each sample in the module, largest first to the least loaded replica; modules on the same ranks in "
            "the same replicas share one assignment by their summed cost) or contiguous (equal runs of samples in "
            "order). The loss and the gradients are the same either way");
    v.field("overlap", overlap,
            "start the data-parallel and ZeRO-1 gradient reductions during the step's last backward, a bucket as soon "
            "as its gradients are complete, on a group of their own (false: all of them after the backward). From the "
            "second step: the first checks that every gradient arrives in one piece");
    v.field("bucket_mb", bucket_mb,
            "MiB of gradients per reduction bucket (one all-reduce or reduce-scatter each; ZeRO-1's optimizer state is "
            "laid out by bucket, and checkpoints load whatever the bucket size)");
    v.field("buckets_in_flight", buckets_in_flight,
            "most gradient buckets started and not yet landed at once (each holds a flat copy of its gradients, on "
            "Gloo an fp32 one of bf16 ones as well): one more starts after the oldest lands. One backend stream or "
            "thread runs them in order, so 2 keeps it busy; more only holds more memory");
    v.section("vision", vision, "vision tower strategy (overrides parallel.strategy)");
    v.section("text", text, "text decoder strategy (overrides parallel.strategy)");
  }
};

struct OutputOptions {
  std::string dir = "runs/demo";  // run directory: metrics.jsonl, config.yaml
  bool hf_export = false;         // write the trained model as a Hugging Face directory
  bool peft_export = false;       // write the LoRA adapters as a PEFT directory
  template <class V>
  void visit(V& v) {
    v.field("dir", dir, "run directory (metrics.jsonl, config.yaml)");
    v.field("hf_export", hf_export,
            "at the end, write the trained model to <dir>/hf as a Hugging Face directory (config.json + safetensors; "
            "LoRA adapters merged into their weights)");
    v.field("peft_export", peft_export,
            "at the end, write the LoRA adapters to <dir>/peft as a PEFT adapter directory (adapter_config.json + "
            "adapter_model.safetensors) that Hugging Face PEFT loads onto the base model");
  }
};

// LoRA (models/qwen2_5_vl/lora.h): low-rank adapters on the named linears of some modules,
// whose base weights are then frozen.
struct LoraOptions {
  int64_t rank = 0;  // 0 = off
  double alpha = 16;
  double dropout = 0;
  std::vector<std::string> targets{"q_proj", "k_proj", "v_proj", "o_proj"};
  std::vector<std::string> modules{"text"};
  std::string from;  // a PEFT adapter directory to continue from
  template <class V>
  void visit(V& v) {
    v.field("rank", rank, "LoRA rank r (0 = no LoRA)");
    v.field("alpha", alpha, "LoRA alpha: the adapters' output is scaled by alpha / rank");
    v.field("dropout", dropout, "dropout on each adapter's input while training (0 = none)");
    v.field("targets", targets,
            "linears that get adapters, as Hugging Face / PEFT name them: q_proj, k_proj, v_proj, o_proj, gate_proj, "
            "up_proj, down_proj (text), qkv, proj, mlp.* (vision), mlp.0, mlp.2 (merger); a name matches itself or "
            "a longer name ending in .NAME, and NAME.* any last component after NAME");
    v.field("modules", modules,
            "which modules get adapters: vision, merger, text; their base weights are frozen, only the adapters train "
            "there (the other modules follow model.*.freeze)");
    v.field("from", from,
            "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) whose adapters training "
            "continues from (its r, lora_alpha and targets must match lora.*; on top of model.from)");
  }
  qwen::LoraSpec spec() const { return {rank, alpha, dropout, targets, modules}; }
};

struct CheckpointOptions {
  std::string dir;         // where step-N directories go ("" = <output.dir>/checkpoints)
  int64_t every = 0;       // save every K steps (0 = none during training)
  int64_t keep = 3;        // keep the newest M (0 = all)
  bool at_end = true;      // save after the last step
  std::string resume;      // "" = start fresh, auto = newest usable under dir, or a step-N directory
  template <class V>
  void visit(V& v) {
    v.field("dir", dir, "directory of the step-N checkpoints (empty = <output.dir>/checkpoints)");
    v.field("every", every, "save a checkpoint every this many steps (0 = only at the end, see at_end)");
    v.field("keep", keep, "keep the newest this many checkpoints, delete older ones (0 = keep all)");
    v.field("at_end", at_end, "save a checkpoint after the last step");
    v.field("resume", resume,
            "empty = start fresh; auto = continue from the newest complete checkpoint in dir (falling back to "
            "older ones when one is damaged; fresh when there is none); or a checkpoint directory (step-N)");
  }
};

struct Config {
  ModelOptions model;
  DataOptions data;
  TrainingOptions training;
  ParallelOptions parallel;
  OutputOptions output;
  CheckpointOptions checkpoint;
  LoraOptions lora;
  template <class V>
  void visit(V& v) {
    v.section("model", model, "model architecture (a preset plus overrides)");
    v.section("data", data, "dataset and batch");
    v.section("training", training, "optimisation");
    v.section("parallel", parallel, "parallel strategy");
    v.section("output", output, "where results go");
    v.section("checkpoint", checkpoint, "saving and resuming the training state");
    v.section("lora", lora, "LoRA adapters (fine-tuning)");
  }
  // Throws dhp::Error naming the bad key and value.
  void validate() const;
};

// Loads the config: defaults, then the file (if any), then each --set in order.
Config load_config(const std::string& file, const std::vector<std::string>& sets);
Config load_config(const ConfigTree& tree);
// checkpoint.dir, or <output.dir>/checkpoints when empty.
std::string checkpoint_root(const Config& cfg);

}  // namespace dhp
