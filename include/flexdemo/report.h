// flexdemo/report.h — `flexdemo report`: compares training runs from their output folders.
#pragma once

#include <string>
#include <vector>

namespace flexdemo::train {

// Reads config.json, metrics.jsonl and summary.json of every run folder and writes into out:
// report.md (a table: final validation loss, tokens/s, bytes between nodes per step, and the
// compression against the AdamW-HSDP run when one is given) and, with gnuplot, PNG plots of
// validation loss against step and against wall time, bytes between nodes per step, and the
// step time split into compute and communication. Returns the Markdown table.
std::string write_report(const std::vector<std::string>& runs, const std::string& out);

}  // namespace flexdemo::train
