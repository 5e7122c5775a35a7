// `flexdemo report`: compares training runs from their output folders. Part of the command, not
// the library: it plots with gnuplot and writes files a study keeps.
#pragma once

#include <string>
#include <vector>

namespace flexdemo::app {

// Reads config.json, metrics.jsonl and summary.json of every run folder and writes into out:
// report.md (a table: final validation loss, tokens/s, bytes between nodes per step, and the
// compression against the AdamW-HSDP run when one is given); evals.csv (every run's validation
// steps: the run folder as given, step, elapsed_s, val_loss, loss, inter_bytes_sent: the compact
// data a study keeps); and, with gnuplot, PNG plots of validation loss against step and against
// wall time, bytes between nodes per step, and the step time split into compute and
// communication. Returns the Markdown table.
std::string write_report(const std::vector<std::string>& runs, const std::string& out);

}  // namespace flexdemo::app
