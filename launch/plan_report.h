// remat-train's --plan-report DIR: the folder checked before training, and
// the planner's frontier (DIR/frontier.csv, written by the planner) drawn as
// DIR/frontier.png by tools/plot_frontier.py, which is compiled in and
// written beside the CSV. The C++ side needs no Python: without python3 and
// matplotlib the command that draws it is logged instead.
#pragma once

#include <string>

namespace remat {

// tools/plot_frontier.py, compiled in.
const std::string& plot_frontier_script();

// Creates `dir` when missing and checks that a file can be written in it: a
// ConfigError naming the folder, the reason and what to change otherwise.
void check_plan_report_dir(const std::string& dir);

// Writes dir/plot_frontier.py and, when python3 imports matplotlib, runs it
// on dir/frontier.csv to draw dir/frontier.png; logs the command otherwise
// (or when it fails). Returns whether the picture was drawn.
bool plot_frontier(const std::string& dir);

}  // namespace remat
