// `flexdemo report`: a Markdown table, the runs' validation steps and gnuplot PNGs comparing run
// folders.
#include "report.h"

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace flexdemo::app {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct Run {
  std::string dir;   // the folder as given
  std::string name;  // the folder's name
  json config, summary;
  std::vector<json> steps;
};

json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("report: cannot read " + path.string());
  return json::parse(in);
}

Run read_run(const std::string& dir) {
  Run r;
  r.dir = dir;
  r.name = fs::path(dir).lexically_normal().filename().string();
  if (r.name.empty()) r.name = fs::path(dir).lexically_normal().parent_path().filename().string();
  r.config = read_json(fs::path(dir) / "config.json");
  r.summary = read_json(fs::path(dir) / "summary.json");
  std::ifstream in(fs::path(dir) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) r.steps.push_back(json::parse(line));
  }
  if (r.steps.empty()) throw std::invalid_argument("report: no metrics in " + dir);
  return r;
}

std::string label(const Run& r) {
  return fmt::format("{} ({}, {})", r.name, r.config.value("optimizer", "?"),
                     r.config.value("replicator", "?"));
}

bool is_hsdp_adamw(const Run& r) {
  return r.config.value("optimizer", "") == "adamw" && r.config.value("replicator", "") == "full";
}

std::string mb(double bytes) {
  return fmt::format("{:.3f}", bytes / 1e6);
}

// The Markdown table, against the AdamW-HSDP run when one is given.
std::string table(const std::vector<Run>& runs) {
  const Run* baseline = nullptr;
  for (const auto& r : runs) {
    if (is_hsdp_adamw(r)) baseline = &r;
  }
  std::ostringstream md;
  md << "| run | optimizer | replicator | steps | final val loss | val loss vs AdamW-HSDP | "
        "tokens/s | MB between nodes per step | fewer bytes than AdamW-HSDP |\n"
     << "|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : runs) {
    const double bytes = r.summary.value("inter_bytes_per_step", 0.0);
    std::string compression = "-", versus = "-";
    if (baseline && bytes > 0) {
      compression =
          fmt::format("{:.0f}x", baseline->summary.value("inter_bytes_per_step", 0.0) / bytes);
    }
    const double loss = r.summary.value("final_val_loss", 0.0);
    if (baseline) {
      const double base = baseline->summary.value("final_val_loss", 0.0);
      versus = fmt::format("{:+.1f}%", 100.0 * (loss - base) / base);
    }
    md << fmt::format("| {} | {} | {} | {} | {:.4f} | {} | {:.0f} | {} | {} |\n", r.name,
                      r.config.value("optimizer", "?"), r.config.value("replicator", "?"),
                      r.summary.value("steps", 0), loss, versus,
                      r.summary.value("tokens_per_s", 0.0), mb(bytes), compression);
  }
  return md.str();
}

// Every run's validation steps, one CSV: the compact data a study keeps.
void write_evals(const std::vector<Run>& runs, const fs::path& file) {
  std::ofstream csv(file);
  csv << "run,step,elapsed_s,val_loss,loss,inter_bytes_sent\n";
  for (const auto& r : runs) {
    for (const auto& s : r.steps) {
      if (!s.contains("val_loss")) continue;
      csv << fmt::format("{},{},{:.3f},{:.6f},{:.6f},{}\n", r.dir, s.value("step", 0),
                         s.value("elapsed_s", 0.0), s["val_loss"].get<double>(),
                         s.value("loss", 0.0), s.value("inter_bytes_sent", int64_t(0)));
    }
  }
}

// gnuplot's data files (one per run, and the step time split) and its script, run in out.
void plot(const std::vector<Run>& runs, const fs::path& out) {
  // Data files for gnuplot: one per run.
  for (size_t i = 0; i < runs.size(); ++i) {
    std::ofstream dat(out / fmt::format("run{}.dat", i));
    dat << "# step elapsed_s val_loss inter_bytes_sent compute_ms comm_ms loss\n";
    for (const auto& s : runs[i].steps) {
      dat << s.value("step", 0) << " " << s.value("elapsed_s", 0.0) << " "
          << (s.contains("val_loss") ? fmt::format("{}", s["val_loss"].get<double>()) : "NaN")
          << " " << s.value("inter_bytes_sent", 0) << " " << s.value("compute_ms", 0.0) << " "
          << s.value("comm_ms", 0.0) << " " << s.value("loss", 0.0) << "\n";
    }
  }
  std::ostringstream gp;
  gp << "set terminal pngcairo size 900,560 noenhanced\nset grid\nset key outside bottom center\n"
     << "set datafile missing 'NaN'\n";
  auto curve = [&](const std::string& file, const std::string& title, const std::string& xlabel,
                  const std::string& ylabel, const std::string& using_spec, const std::string& with,
                  bool logy) {
    gp << "set output '" << file << "'\nset title '" << title << "'\nset xlabel '" << xlabel
       << "'\nset ylabel '" << ylabel << "'\n"
       << (logy ? "set logscale y\n" : "unset logscale y\n") << "plot ";
    for (size_t i = 0; i < runs.size(); ++i) {
      gp << (i ? ", " : "") << "'run" << i << ".dat' using " << using_spec << " with " << with
         << " title '" << label(runs[i]) << "'";
    }
    gp << "\n";
  };
  curve("val_loss_vs_step.png", "Validation loss", "step", "loss", "1:3", "linespoints", false);
  curve("val_loss_vs_time.png", "Validation loss against wall time", "seconds", "loss", "2:3",
       "linespoints", false);
  curve("inter_bytes_per_step.png", "Bytes between nodes per step (all ranks)", "step", "bytes",
       "1:4", "lines", true);
  // Mean step time split into compute and communication, one pair of bars per run.
  {
    std::ofstream split(out / "step_split.dat");
    split << "# run compute_ms comm_ms\n";
    for (size_t i = 0; i < runs.size(); ++i) {
      double compute = 0, comm = 0;
      for (const auto& s : runs[i].steps) {
        compute += s.value("compute_ms", 0.0);
        comm += s.value("comm_ms", 0.0);
      }
      split << '"' << runs[i].name << "\" " << compute / runs[i].steps.size() << " "
            << comm / runs[i].steps.size() << "\n";
    }
    gp << "set output 'step_time_split.png'\nset title 'Mean step time per rank'\n"
       << "set xlabel ''\nset ylabel 'ms'\nunset logscale y\nset style data histograms\n"
       << "set style histogram rowstacked\nset style fill solid 0.8 border -1\nset boxwidth 0.6\n"
       << "plot 'step_split.dat' using 2:xtic(1) title 'compute', '' using 3 title "
          "'communication'\n";
  }
  std::ofstream(out / "plots.gp") << gp.str();
  const std::string cmd =
      "cd '" + fs::absolute(out).string() + "' && gnuplot plots.gp 2> gnuplot.log";
  if (std::system(cmd.c_str()) != 0) {
    throw std::runtime_error("report: gnuplot failed; see " + (out / "gnuplot.log").string());
  }
}

}  // namespace

std::string write_report(const std::vector<std::string>& run_dirs, const std::string& out) {
  if (run_dirs.empty()) throw std::invalid_argument("report: give at least one run folder");
  std::vector<Run> runs;
  for (const auto& d : run_dirs) runs.push_back(read_run(d));
  fs::create_directories(out);
  const std::string md = table(runs);
  std::ofstream(fs::path(out) / "report.md") << md;
  write_evals(runs, fs::path(out) / "evals.csv");
  plot(runs, out);
  return md;
}

}  // namespace flexdemo::app
